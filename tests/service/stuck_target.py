"""The target service's own `main`, its model's forward blocking forever once the file FLAG exists (a forward stuck
on its device); it prints "forward stuck" when it blocks.

Usage: python -m tests.service.stuck_target FLAG [target-service arguments...]
"""

import functools
import os
import sys
import threading

import transformers.models.llama.modeling_llama as llama

from specwire.target_service.__main__ import main

original = llama.LlamaForCausalLM.forward


@functools.wraps(original)
def forward(self, *args, **kwargs):
    if os.path.exists(FLAG):
        print("forward stuck", flush=True)
        threading.Event().wait()
    return original(self, *args, **kwargs)


if __name__ == "__main__":
    FLAG = sys.argv[1]
    llama.LlamaForCausalLM.forward = forward
    main(sys.argv[2:])
