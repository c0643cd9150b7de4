"""`python -m bench.soak`: a long mixed load against the three services, with faults, watched over time.

Starts config, draft and target services as child processes on loopback (as `python -m bench` does),
runs `--clients` threads of mixed requests for `--minutes`, kills and restarts the draft service and
restarts the config service on a schedule, samples each service's RSS, threads and open fds every
`--interval` seconds, and writes soak.json, soak.md and soak.png. See `bench.soak.kinds` for the
request kinds and the statuses each may get, and `bench.soak.evaluate` for the targets.
"""
