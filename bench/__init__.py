"""specwire benchmarks: every workload through the gRPC services and through in-process
`transformers.generate()` on the same weights, alternating, with JSON, Markdown and PNG results.

Run `python -m bench --help`; the README's "Benchmarks" section shows the latest results.
"""
