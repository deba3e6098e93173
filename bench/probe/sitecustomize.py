"""A measuring probe for bench/profile_async.py, loaded by Python at start-up (this folder first
on PYTHONPATH) in the process that finds VIME_PROBE set, and in no other: the variable is
removed at once, so the engines and workers the run starts never see it.

VIME_PROBE is JSON: {"out": path, "switch_interval": s or null, "hog": [busy_ms, sleep_ms] or null}.
* Every `Actor.train_step` writes one line to `out`: its wall time and the CPU seconds each
  thread of the process ran meanwhile (from /proc/self/task/*/schedstat, nanoseconds), with the
  seconds each spent runnable but waiting for a core. A train step that is bound by its host
  shows main-thread CPU close to its wall time; a thread of the rollout loop that runs during it
  takes the GIL from it.
* `switch_interval`: sys.setswitchinterval, how long a thread that wants the GIL waits before it
  asks the holder to drop it (CPython's default 5 ms).
* `hog`: a thread that runs pure Python for busy_ms, then sleeps sleep_ms, for ever: a stand-in
  for a busy rollout loop, with no GPU work and no HTTP, to measure how much a train step
  slows when another thread of its process wants the GIL.
"""

import os

_spec = os.environ.pop("VIME_PROBE", None)

if _spec:
    import functools
    import json
    import sys
    import threading
    import time

    _cfg = json.loads(_spec)
    if _cfg.get("switch_interval"):
        sys.setswitchinterval(float(_cfg["switch_interval"]))

    def _threads() -> dict[str, tuple[int, int]]:
        """Thread name -> (ns on a core, ns waiting for one), summed over threads of one name."""
        names = {t.native_id: t.name for t in threading.enumerate()}
        out: dict[str, tuple[int, int]] = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    run, wait = (int(x) for x in f.read().split()[:2])
                name = names.get(int(tid))
                if name is None:
                    with open(f"/proc/self/task/{tid}/comm") as f:
                        name = "native:" + f.read().strip()
            except (OSError, ValueError):
                continue  # the thread ended meanwhile
            if name.startswith("vime-generate"):
                name = "vime-generate"
            a, b = out.get(name, (0, 0))
            out[name] = (a + run, b + wait)
        return out

    def _patch() -> None:
        from vime.trainer.actor import Actor

        inner = Actor.train_step

        @functools.wraps(inner)
        def train_step(self, *a, **k):
            c0, t0 = _threads(), time.perf_counter()
            try:
                return inner(self, *a, **k)
            finally:
                t1, c1 = time.perf_counter(), _threads()
                cpu = {
                    n: [(c1[n][0] - c0.get(n, (0, 0))[0]) / 1e9, (c1[n][1] - c0.get(n, (0, 0))[1]) / 1e9] for n in c1
                }
                with open(_cfg["out"], "a") as f:
                    f.write(json.dumps({"t0": t0, "wall": t1 - t0, "cpu": cpu}) + "\n")

        Actor.train_step = train_step

    def _watch() -> None:
        """Patch the actor once vime's trainer is imported (the run imports it after start-up)."""
        while "vime.trainer.actor" not in sys.modules or not hasattr(sys.modules["vime.trainer.actor"], "Actor"):
            time.sleep(0.05)
        time.sleep(0.2)  # the module's body has run to its end
        _patch()

    threading.Thread(target=_watch, name="vime-probe", daemon=True).start()

    if _cfg.get("hog"):
        busy, sleep = (x / 1000 for x in _cfg["hog"])

        def _hog() -> None:
            while True:
                end = time.perf_counter() + busy
                n = 0
                while time.perf_counter() < end:
                    n += 1
                time.sleep(sleep)

        threading.Thread(target=_hog, name="vime-probe-hog", daemon=True).start()
