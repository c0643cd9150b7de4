"""The constraint states of constrained beam search, as transformers 4.55.4's generation/beam_constraints.py.

`PhrasalConstraint` (a token sequence that must appear), `DisjunctiveConstraint` (one of several token
sequences) and `ConstraintListState` (a hypothesis' progress through all of them: its *bank* ranks
candidates). The outputs of 4.55.4 depend on the quirks of these classes, so they are kept on purpose:
a phrasal constraint reset after a mismatch counts its first token as fulfilled (`fulfilled_idx = 0`),
and a stateful copy of a disjunctive constraint shares its progress list with the original.
"""

from __future__ import annotations

from typing import Any

from specwire.generation.config.constraint_data import constraint_parts

__all__ = [
    "ConstraintListState",
    "DisjunctiveConstraint",
    "PhrasalConstraint",
    "constraint_parts",
    "constraints_from_config",
]


class PhrasalConstraint:
    """
    `token_ids` must appear in the output, in order and contiguous.

    Args:
        token_ids (`list[int]`): the sequence.
    """

    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids
        self.seqlen = len(token_ids)
        self.fulfilled_idx = -1
        self.completed = False

    def advance(self) -> int | None:
        return None if self.completed else self.token_ids[self.fulfilled_idx + 1]

    def does_advance(self, token_id: int) -> bool:
        return not self.completed and token_id == self.token_ids[self.fulfilled_idx + 1]

    def update(self, token_id: int) -> tuple[bool, bool, bool]:
        """`(stepped, completed, reset)` after `token_id`."""
        if self.does_advance(token_id):
            self.fulfilled_idx += 1
            self.completed = self.fulfilled_idx == self.seqlen - 1
            return True, self.completed, False
        self.reset()
        return False, False, True

    def reset(self) -> None:
        self.completed = False
        self.fulfilled_idx = 0  # 4.55.4's value (not -1): kept, see the module docstring

    def remaining(self) -> int:
        return self.seqlen - (self.fulfilled_idx + 1)

    def copy(self, stateful: bool = False) -> PhrasalConstraint:
        new = PhrasalConstraint(self.token_ids)
        if stateful:
            new.fulfilled_idx, new.completed = self.fulfilled_idx, self.completed
        return new


class _Trie:
    """The prefix tree of a disjunctive constraint's sequences."""

    def __init__(self, sequences: list[list[int]]):
        self.max_height = max(len(s) for s in sequences)
        self.root: dict[int, Any] = {}
        for sequence in sequences:
            level = self.root
            for token in sequence:
                level = level.setdefault(token, {})

    def next_tokens(self, prefix: list[int]) -> list[int]:
        level = self.root
        for token in prefix:
            level = level[token]
        return list(level)

    def leaves(self, level: dict[int, Any] | None = None) -> int:
        level = self.root if level is None else level
        return sum(self.leaves(child) for child in level.values()) if level else 1


class DisjunctiveConstraint:
    """
    One of `nested_token_ids` must appear in the output.

    Args:
        nested_token_ids (`list[list[int]]`): the sequences; none may be a prefix of another.
    """

    def __init__(self, nested_token_ids: list[list[int]]):
        self.trie = _Trie(nested_token_ids)
        self.token_ids = nested_token_ids
        self.seqlen = self.trie.max_height
        self.current_seq: list[int] = []
        self.completed = False

    def advance(self) -> list[int] | None:
        return self.trie.next_tokens(self.current_seq) or None

    def does_advance(self, token_id: int) -> bool:
        return token_id in self.trie.next_tokens(self.current_seq)

    def update(self, token_id: int) -> tuple[bool, bool, bool]:
        """`(stepped, completed, reset)` after `token_id`."""
        stepped = self.does_advance(token_id)
        if stepped:
            self.current_seq.append(token_id)  # in place: a stateful copy shares the list (4.55.4)
        else:
            self.reset()
        self.completed = not self.trie.next_tokens(self.current_seq)
        return stepped, self.completed, not stepped

    def reset(self) -> None:
        self.completed = False
        self.current_seq = []

    def remaining(self) -> int:
        return 0 if self.completed else self.seqlen - len(self.current_seq)

    def copy(self, stateful: bool = False) -> DisjunctiveConstraint:
        new = DisjunctiveConstraint(self.token_ids)
        if stateful:
            new.current_seq, new.completed = self.current_seq, self.completed
        return new


Constraint = PhrasalConstraint | DisjunctiveConstraint


class ConstraintListState:
    """
    A hypothesis' progress through every constraint: at most one in progress at a time.

    Args:
        constraints (`list[PhrasalConstraint | DisjunctiveConstraint]`): the request's constraints.
    """

    def __init__(self, constraints: list[Constraint]):
        self.constraints = constraints
        self.max_seqlen = max(c.seqlen for c in constraints)
        self.completed = False
        self.init_state()

    def init_state(self) -> None:
        self.complete_constraints: list[Constraint] = []
        self.inprogress_constraint: Constraint | None = None
        self.pending_constraints: list[Constraint] = [c.copy(stateful=False) for c in self.constraints]

    def get_bank(self) -> int:
        """Progress: `max_seqlen` per completed constraint, plus the tokens of the one in progress."""
        add = self.max_seqlen - self.inprogress_constraint.remaining() if self.inprogress_constraint else 0
        return len(self.complete_constraints) * self.max_seqlen + add

    def advance(self) -> list[int] | None:
        """The tokens that would make progress."""
        sources = self.pending_constraints if self.inprogress_constraint is None else [self.inprogress_constraint]
        tokens: list[int] = []
        for constraint in sources:
            advance = constraint.advance()
            if isinstance(advance, int):
                tokens.append(advance)
            elif isinstance(advance, list):
                tokens.extend(advance)
        return tokens or None

    def reset(self, token_ids: list[int] | None) -> None:
        """The state after `token_ids` from scratch."""
        self.init_state()
        for token in token_ids or []:
            self.add(token)
            if self.completed:
                break

    def add(self, token_id: int) -> None:
        """Steps the state with `token_id`."""
        if self.completed:
            return
        if self.inprogress_constraint is not None:
            _, complete, reset = self.inprogress_constraint.update(token_id)
            if reset:
                self.pending_constraints.append(self.inprogress_constraint.copy(stateful=False))
                self.inprogress_constraint = None
            if complete:
                self.complete_constraints.append(self.inprogress_constraint)  # type: ignore[arg-type]
                self.inprogress_constraint = None
                if not self.pending_constraints:
                    self.completed = True
            return
        for index, pending in enumerate(self.pending_constraints):
            if not pending.does_advance(token_id):
                continue
            _, complete, _ = pending.update(token_id)
            if complete:
                self.complete_constraints.append(pending)
            else:
                self.inprogress_constraint = pending
            del self.pending_constraints[index]
            if not self.pending_constraints and self.inprogress_constraint is None:
                self.completed = True
            break  # one token steps one constraint

    def copy(self, stateful: bool = True) -> ConstraintListState:
        new = ConstraintListState(self.constraints)
        if stateful:
            new.complete_constraints = [c.copy(stateful=True) for c in self.complete_constraints]
            if self.inprogress_constraint is not None:
                new.inprogress_constraint = self.inprogress_constraint.copy(stateful=True)
            new.pending_constraints = [c.copy() for c in self.pending_constraints]
        return new


def constraints_from_config(constraints: list[Any] | None, force_words_ids: list[Any] | None) -> list[Constraint]:
    """4.55.4's constraint list: `constraints` first, then one per `force_words_ids` entry.

    Args:
        constraints (`list`, *optional*): plain data (see `constraint_parts`), or constraint objects.
        force_words_ids (`list`, *optional*): each entry a token-id list (phrasal) or a list of them (disjunctive).
    """
    result: list[Constraint] = []
    for item in constraints or []:
        if isinstance(item, (PhrasalConstraint, DisjunctiveConstraint)):
            result.append(item)
            continue
        kind, ids = constraint_parts(item) or ("", [])
        if kind == "phrasal":
            result.append(PhrasalConstraint([int(t) for t in ids]))
        else:
            result.append(DisjunctiveConstraint([[int(t) for t in s] for s in ids]))
    for word_ids in force_words_ids or []:
        if isinstance(word_ids[0], list):
            result.append(DisjunctiveConstraint([[int(t) for t in s] for s in word_ids]))
        else:
            result.append(PhrasalConstraint([int(t) for t in word_ids]))
    return result
