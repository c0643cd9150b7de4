"""The benchmark prompts: a chat question with a long answer, an input-grounded code edit, and a
low-acceptance prompt (an answer with nothing to copy and many near-ties, where drafts mostly miss)."""

from __future__ import annotations

CHAT_PROMPT = (
    "Explain in detail how a web browser loads a page, from typing the address to drawing the pixels. "
    "Cover DNS, TCP, TLS, HTTP, parsing HTML and CSS, layout and painting."
)

# ~300 tokens of code that the answer mostly copies: the case prompt lookup is made for.
CODE_SNIPPET = """\
import json
from dataclasses import dataclass, field


@dataclass
class Order:
    order_id: int
    customer: str
    items: list[dict] = field(default_factory=list)
    discount: float = 0.0

    def subtotal(self) -> float:
        total = 0.0
        for item in self.items:
            total += item["price"] * item["quantity"]
        return total

    def total(self) -> float:
        subtotal = self.subtotal()
        return subtotal - subtotal * self.discount

    def add_item(self, name: str, price: float, quantity: int = 1) -> None:
        self.items.append({"name": name, "price": price, "quantity": quantity})


def load_orders(path: str) -> list[Order]:
    with open(path) as handle:
        raw = json.load(handle)
    orders = []
    for entry in raw:
        order = Order(entry["order_id"], entry["customer"], discount=entry.get("discount", 0.0))
        for item in entry["items"]:
            order.add_item(item["name"], item["price"], item["quantity"])
        orders.append(order)
    return orders


def report(orders: list[Order]) -> str:
    lines = []
    for order in orders:
        lines.append(f"{order.order_id} {order.customer}: {order.total():.2f}")
    return "\\n".join(lines)
"""

CODE_EDIT_PROMPT = (
    "Rename the method `subtotal` to `items_total` everywhere in this code and return the whole file, "
    "unchanged otherwise:\n\n```python\n" + CODE_SNIPPET + "```"
)

# Random-looking strings: nothing in the prompt to copy (prompt lookup finds little) and flat next-token
# distributions (an int8 draft's argmax often differs from the target's).
LOW_ACCEPTANCE_PROMPT = (
    "Write thirty random passwords, each twelve characters long, mixing upper and lower case letters, "
    "digits and symbols such as #, %, & and @. One per line, numbered, with no other text."
)

# The three prompts by the keys the benchmark's results name them with.
PROMPTS = {"chat": CHAT_PROMPT, "code": CODE_EDIT_PROMPT, "low": LOW_ACCEPTANCE_PROMPT}
