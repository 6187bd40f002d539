"""A real EPD under `ecshare launch --cpu`: push's exposed latency and each process's CPU
per request, thread by thread.

    python benchmarks/launch_push.py [--requests 20] [--no-push] [--env KEY=VALUE ...]
        [--idle-s 5] [--json PATH]

It builds a wide tiny Qwen2-VL (`ecshare.vllm.tiny_model`, widened to a text hidden size
of 2560 in bfloat16, so that one 1232x560 image is 880 tokens, one 4,505,600-byte item),
starts `ecshare launch --cpu` over it (one encoder, one prefill/decode instance, push on
unless --no-push), sends one warm-up request, then measures:

* an idle window (--idle-s) with no request: CPU-seconds per second per process and
  thread, which should be close to zero, and the CPU-seconds each process spends in the
  2 s right after the last answer (an engine's wait that spins shows there);
* --requests requests, one at a time, each with a new random 1232x560 image:
  - the prefill/decode instance's own `exposed_latency_seconds{mode=...}` (read after
    each request, so that each request's item has its exact value, not a bucket's), as
    p50/p90/max per mode;
  - CPU-seconds per request of every process of each instance (and of launch itself, which
    runs the proxy), from /proc/<pid>/stat, and per thread from /proc/<pid>/task/*/stat,
    grouped by thread name; the time of threads that ended inside the window is the
    process's total less its live threads';
  - the engine's own per-request times (`vllm:request_prefill_time_seconds` and
    `vllm:e2e_request_latency_seconds`) on each instance.

CPU-seconds per request depend little on what else the host runs; latencies depend a lot,
so quote both over several runs with the load (`uptime`). --env sets a variable for every
instance (e.g. OMP_WAIT_POLICY=PASSIVE), to compare settings. Prints a table, and with
--json the whole report.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

WIDTH, HEIGHT = 1232, 560  # 44 x 20 tokens of 28x28 pixels: 880 tokens
HIDDEN = 2560
ITEM_BYTES = WIDTH * HEIGHT // (28 * 28) * HIDDEN * 2  # bfloat16
CLK_TCK = os.sysconf("SC_CLK_TCK")
EXPOSED = "vllm:ecshare_exposed_latency_seconds"
ENGINE_TIMES = ("vllm:request_prefill_time_seconds", "vllm:e2e_request_latency_seconds")
TAIL_S = 2.0
VLLM_ARGS = "--dtype bfloat16 --max-model-len 2048 --max-num-batched-tokens 2048"


# ---------------------------------------------------------------- the model


def build_wide_model(directory: Path) -> Path:
    """The tiny Qwen2-VL widened to `HIDDEN` in bfloat16, built once into `directory`."""
    marker = directory / "wide.json"
    want = {"hidden": HIDDEN, "max_tokens": 1024, "version": 1}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return directory
    # A child process, so that this one never loads torch.
    subprocess.run(
        [sys.executable, "-c", _WIDEN, str(directory), json.dumps(want)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return directory


# Builds the tiny model, then replaces its config and weights with a wider text model
# (20 heads of 128, the CPU attention's head size) and lets the processor take 1024 tokens.
_WIDEN = """
import json, sys, torch
from pathlib import Path
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
from ecshare.vllm.tiny_model import build_tiny_qwen2vl
out, want = Path(sys.argv[1]), json.loads(sys.argv[2])
build_tiny_qwen2vl(out, dtype="bfloat16")
config = json.loads((out / "config.json").read_text())
text = config["text_config"]
text.update(hidden_size=want["hidden"], num_attention_heads=20, num_key_value_heads=2)
text["rope_parameters"]["mrope_section"] = [16, 24, 24]
config["vision_config"]["hidden_size"] = want["hidden"]
with torch.random.fork_rng(devices=[]):
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(**config))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
processor = json.loads((out / "processor_config.json").read_text())
for part in ("image_processor", "video_processor"):
    processor[part]["size"]["longest_edge"] = want["max_tokens"] * 28 * 28
(out / "processor_config.json").write_text(json.dumps(processor, indent=2))
(out / "wide.json").write_text(json.dumps(want))
"""


# ---------------------------------------------------------------- /proc


@dataclass
class ProcCpu:
    """One process's CPU ticks: its total, and each live thread's (tid -> (name, ticks))."""

    pid: int
    name: str
    total: int
    threads: dict[int, tuple[str, int]] = field(default_factory=dict)


def _stat_fields(text: str) -> tuple[str, list[str]]:
    """(comm, the fields after it) of a /proc stat line; comm may hold spaces and ')'."""
    left, right = text.index("("), text.rindex(")")
    return text[left + 1 : right], text[right + 2 :].split()


def stat_ticks(text: str) -> tuple[str, int]:
    """(comm, utime + stime in clock ticks) of a /proc/<pid>/stat or task stat line."""
    comm, rest = _stat_fields(text)
    return comm, int(rest[11]) + int(rest[12])


def read_proc(pid: int) -> ProcCpu | None:
    """The process's ticks now, or None when it is gone."""
    try:
        name, total = stat_ticks(Path(f"/proc/{pid}/stat").read_text())
        threads = {}
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                threads[int(task.name)] = stat_ticks((task / "stat").read_text())
            except (OSError, ValueError):
                continue  # it ended between the listing and the read
    except (OSError, ValueError):
        return None
    return ProcCpu(pid, name, total, threads)


def _pids_whose_stat(field: int, value: int) -> list[int]:
    """The processes whose /proc stat field `field` (counted after the comm) is `value`."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                _, rest = _stat_fields((entry / "stat").read_text())
            except (OSError, ValueError):
                continue
            if int(rest[field]) == value:
                out.append(int(entry.name))
    return sorted(out)


def session_pids(sid: int) -> list[int]:
    """The processes of session `sid` (an instance's process group: API server, engine
    core and their helpers)."""
    return _pids_whose_stat(3, sid)


def child_pids(ppid: int) -> list[int]:
    return _pids_whose_stat(1, ppid)


def thread_kind(name: str, tid: int, pid: int) -> str:
    """A coarse owner of a thread, by its name."""
    if name.startswith("ecshare"):
        return "ecshare"
    if tid == pid:
        return "main"
    lowered = name.lower()
    if lowered.startswith(("ucx", "nixl", "ucp", "uct")) or "progress" in lowered:
        return "nixl/ucx"
    return "other"


def cpu_delta(before: dict[int, ProcCpu], after: dict[int, ProcCpu]) -> dict[str, Any]:
    """Per process (by pid): seconds of CPU between the two readings, in all and per thread
    name (threads of one name summed), and what threads that ended took."""
    out: dict[str, Any] = {}
    for pid, now in after.items():
        then = before.get(pid, ProcCpu(pid, now.name, 0))
        threads: dict[str, float] = defaultdict(float)
        kinds: dict[str, float] = defaultdict(float)
        live = 0
        for tid, (name, ticks) in now.threads.items():
            spent = ticks - then.threads.get(tid, (name, 0))[1]
            live += spent
            label = "main" if tid == pid else name
            threads[label] += spent / CLK_TCK
            kinds[thread_kind(name, tid, pid)] += spent / CLK_TCK
        # A process's total is never less than what its live threads took: some kernels
        # (a sandboxed one in CI) update the process's total later than its threads'.
        total = max(now.total - then.total, live) / CLK_TCK
        out[str(pid)] = {
            "name": now.name,
            "cpu_s": total,
            "ended_threads_s": max(0.0, total - live / CLK_TCK),
            "threads": dict(sorted(threads.items(), key=lambda kv: -kv[1])),
            "kinds": dict(kinds),
        }
    return out


# ---------------------------------------------------------------- metrics


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus exposition, keyed by (name, sorted labels)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def summed(samples: dict[Any, float], name: str, **match: str) -> float:
    """The sum of `name`'s samples whose labels include `match`."""
    return sum(
        v
        for (n, labels), v in samples.items()
        if n == name and all((k, val) in labels for k, val in match.items())
    )


def _change(before: dict[Any, float], after: dict[Any, float], name: str, **match: str) -> float:
    return summed(after, name, **match) - summed(before, name, **match)


def scrape(url: str) -> dict[Any, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return metric_samples(resp.read().decode())


def quantiles(values: list[float]) -> dict[str, float | int | None]:
    """n, p50, p90 and max (nearest rank), or None where there is nothing."""
    if not values:
        return {"n": 0, "p50": None, "p90": None, "max": None}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1]

    return {"n": len(ordered), "p50": rank(0.5), "p90": rank(0.9), "max": ordered[-1]}


# ---------------------------------------------------------------- phase marks

# Installed (as sitecustomize) in every process launch starts, with --phases: each
# Producer and Consumer started gets a PhaseLog (ecshare.peer.phases), which a thread
# appends to a file every 0.2 s, so that both instances' marks of each push lie on one
# time line (CLOCK_MONOTONIC is the host's).
_SITECUSTOMIZE = """
import json, os, threading, time
from ecshare.peer import thread as _thread
from ecshare.peer.phases import PhaseLog

_start = _thread.NetworkThread.start

def _logged_start(self):
    out = _start(self)
    log = self.phases = PhaseLog()
    path = os.path.join(
        os.environ["LAUNCH_PUSH_PHASES"], f"{os.getpid()}-{type(self).__name__}.jsonl"
    )

    def flush():
        while True:
            time.sleep(0.2)
            marks = log.take()
            if marks:
                with open(path, "a") as f:
                    f.writelines(json.dumps(m) + "\\n" for m in marks)

    threading.Thread(target=flush, name="bench-phases", daemon=True).start()
    return out

_thread.NetworkThread.start = _logged_start
"""


def install_phase_logs(directory: Path) -> dict[str, str]:
    """The environment that makes launch's processes log push phases into `directory`."""
    (directory / "site").mkdir(parents=True, exist_ok=True)
    (directory / "site" / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    path = [str(directory / "site"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path), "LAUNCH_PUSH_PHASES": str(directory)}


def read_phase_logs(directory: Path) -> list[tuple[str, str, float]]:
    out = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            key, phase, at = json.loads(line)
            out.append((str(key), str(phase), float(at)))
    return out


def push_steps(records: list[tuple[str, str, float]]) -> dict[str, Any]:
    """Per pushed item: how long before prefill/decode asked (`call`) its push was asked
    (`push_call`), how late it was committed after that ask, and each step's ms
    (PUSH_STEPS of the pipeline bench); the late ones listed, the steps' medians of all."""
    from ecshare.apps.bench.pipeline import PUSH_STEPS, _push_marks

    marks = _push_marks(records, [])
    items: list[dict[str, Any]] = []
    for key, m in marks.items():
        if "push_call" not in m or "call" not in m or "committed" not in m:
            continue
        steps, before = {}, "push_call"
        for mark, name in PUSH_STEPS[1:]:
            if mark in m and before in m:
                steps[name] = round((m[mark] - m[before]) * 1000, 3)
            before = mark
        items.append(
            {
                "mm_hash": key[:16],
                "slack_ms": round((m["call"] - m["push_call"]) * 1000, 3),
                "late_ms": round((m["committed"] - m["call"]) * 1000, 3),
                "steps_ms": steps,
            }
        )
    names = [name for _, name in PUSH_STEPS[1:]]
    medians = {
        n: sorted(v)[len(v) // 2]
        for n in names
        if (v := [i["steps_ms"][n] for i in items if n in i["steps_ms"]])
    }
    return {
        "items": len(items),
        "median_steps_ms": medians,
        "late": [i for i in items if i["late_ms"] > 0],
    }


# ---------------------------------------------------------------- the run


@dataclass
class Launched:
    proc: subprocess.Popen[str]
    lines: list[str]
    url: str
    encoder: str
    pd: str


def start_launch(model: Path, workdir: Path, push: bool, env: dict[str, str]) -> Launched:
    from ecshare.apps.ready import LaunchReady, parse_ready
    from ecshare.vllm.servers import popen_session

    command = [
        sys.executable, "-m", "ecshare", "launch", "--cpu", "--model", str(model),
        "--served-model-name", "tiny", "--port", "0", "--workdir", str(workdir),
        "--extra-vllm-args", VLLM_ARGS,
        "--ec-extra-config", json.dumps({"region_bytes": 256 << 20}),
    ]  # fmt: skip
    if not push:
        command.append("--no-push")
    proc = popen_session(
        command,
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    ready: list[LaunchReady] = []
    got = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            found = parse_ready(line, LaunchReady)
            if found is not None:
                ready.append(found)
                got.set()
        got.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        got.wait(900)
        if not ready:
            raise RuntimeError("ecshare launch did not get ready:\n" + "\n".join(lines[-40:]))
    except BaseException:  # Ctrl-C too: never leave the instances behind
        stop_launch(proc)
        raise
    r = ready[0]
    return Launched(proc, lines, r.url, r.encoders[0], r.prefill_decode[0])


def stop_launch(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def instance_sessions(launch_pid: int, launched: Launched) -> dict[str, int]:
    """{"encoder": sid, "prefill_decode": sid}: each instance's session, found by the port
    on its command line."""
    out = {}
    for pid in child_pids(launch_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in cmdline]
        if "--port" in args:
            port = args[args.index("--port") + 1]
            for role, url in (("encoder", launched.encoder), ("prefill_decode", launched.pd)):
                if url.endswith(":" + port):
                    out[role] = pid
    return out


def snapshot(groups: dict[str, list[int]]) -> dict[str, dict[int, ProcCpu]]:
    out = {}
    for group, pids in groups.items():
        out[group] = {p: c for p in pids if (c := read_proc(p)) is not None}
    return out


def per_unit(delta: dict[str, Any], units: float) -> dict[str, Any]:
    """`cpu_delta`'s figures divided by `units` (requests, or seconds)."""
    out = {}
    for pid, d in delta.items():
        out[pid] = {
            "name": d["name"],
            "cpu_s": d["cpu_s"] / units,
            "ended_threads_s": d["ended_threads_s"] / units,
            "threads": {k: v / units for k, v in d["threads"].items()},
            "kinds": {k: v / units for k, v in d["kinds"].items()},
        }
    return out


def post(url: str, body: dict[str, Any]) -> None:
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as resp:
        json.load(resp)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ecshare.vllm.servers import chat_request, random_image_url

    cache = Path(args.model_dir)
    model = build_wide_model(cache)
    env = dict(kv.split("=", 1) for kv in args.env)
    workdir = Path(tempfile.mkdtemp(prefix="launch-push-"))
    if args.phases:
        env.update(install_phase_logs(workdir / "phases"))
    launched = start_launch(model, workdir, not args.no_push, env)
    try:
        sessions = instance_sessions(launched.proc.pid, launched)
        groups = {role: session_pids(sid) for role, sid in sessions.items()}
        groups["launch"] = [launched.proc.pid]
        seed = random.SystemRandom().randrange(1 << 40)

        def request(n: int) -> dict[str, Any]:
            return chat_request([random_image_url(seed + n, WIDTH, HEIGHT)], max_tokens=8)

        for n in range(args.warmup):
            post(launched.url, request(-1 - n))
        time.sleep(1.0)  # the warm-up's last stats reach the frontends
        before = snapshot(groups)
        time.sleep(args.idle_s)
        idle = {
            g: per_unit(cpu_delta(before[g], a), args.idle_s) for g, a in snapshot(groups).items()
        }

        bodies = [request(n) for n in range(args.requests)]  # encoded before the window
        encoder_before, pd_before = scrape(launched.encoder), scrape(launched.pd)
        before = snapshot(groups)
        last = pd_before
        exposed: dict[str, list[float]] = {"pushed": [], "pulled": []}
        unattributed = 0
        t0 = time.monotonic()
        for body in bodies:
            post(launched.url, body)
            now = scrape(launched.pd)
            counts = {
                m: summed(now, EXPOSED + "_count", mode=m)
                - summed(last, EXPOSED + "_count", mode=m)
                for m in exposed
            }
            for mode, count in counts.items():
                s = summed(now, EXPOSED + "_sum", mode=mode) - summed(
                    last, EXPOSED + "_sum", mode=mode
                )
                if count == 1:
                    exposed[mode].append(s)
                elif count:
                    unattributed += int(count)
            last = now
        wall = time.monotonic() - t0
        after = snapshot(groups)
        # What each process spends once the last request has been answered: the engine's
        # own waiting, with nothing to do.
        time.sleep(TAIL_S)
        tail = {g: per_unit(cpu_delta(after[g], a), 1.0) for g, a in snapshot(groups).items()}
        encoder_after = scrape(launched.encoder)
        pd_after = last
        n = args.requests
        engine = {}
        for role, (b, a) in {
            "encoder": (encoder_before, encoder_after),
            "prefill_decode": (pd_before, pd_after),
        }.items():
            engine[role] = {
                name.split(":")[1]: (summed(a, name + "_sum") - summed(b, name + "_sum"))
                / max(1.0, summed(a, name + "_count") - summed(b, name + "_count"))
                for name in ENGINE_TIMES
            }
        cpu = {g: per_unit(cpu_delta(before[g], after[g]), n) for g in groups}
        return {
            "requests": n,
            "push": not args.no_push,
            "env": env,
            "item_bytes": ITEM_BYTES,
            "wall_s_per_request": wall / n,
            "load": os.getloadavg(),
            "exposed_s": {m: quantiles(v) for m, v in exposed.items()},
            "exposed_unattributed": unattributed,
            "engine_s_per_request": engine,
            "cpu_s_per_request": cpu,
            "idle_cpu_s_per_s": idle,
            "cpu_s_after_last_request": tail,
            "push_steps": push_steps(read_phase_logs(workdir / "phases")) if args.phases else None,
        }
    finally:
        stop_launch(launched.proc)
        if not args.keep:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------- the table


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.3f}"


def table(report: dict[str, Any], top: int = 6) -> str:
    lines = [
        f"{report['requests']} requests of one {report['item_bytes']:,} B item, push "
        f"{'on' if report['push'] else 'off'}, env {report['env'] or '-'}, load "
        f"{' '.join(f'{x:.2f}' for x in report['load'])}, "
        f"{report['wall_s_per_request'] * 1e3:.0f} ms per request",
        "",
        "exposed latency at prefill/decode (ms): mode  n  p50  p90  max",
    ]
    for mode, q in report["exposed_s"].items():
        lines.append(f"  {mode:7} {q['n']:3}  {_ms(q['p50'])}  {_ms(q['p90'])}  {_ms(q['max'])}")
    lines.append("")
    lines.append("engine's own time per request (ms): prefill, e2e")
    for role, times in report["engine_s_per_request"].items():
        values = "  ".join(f"{k} {v * 1e3:.1f}" for k, v in times.items())
        lines.append(f"  {role:15} {values}")
    for title, key in (
        ("CPU-s per request", "cpu_s_per_request"),
        ("idle CPU-s per s", "idle_cpu_s_per_s"),
        (f"CPU-s in the {TAIL_S:g} s after the last answer", "cpu_s_after_last_request"),
    ):
        lines.append("")
        lines.append(f"{title}, per process, then its busiest threads:")
        for group, procs in report[key].items():
            for _pid, p in sorted(procs.items(), key=lambda kv: -kv[1]["cpu_s"]):
                if p["cpu_s"] < 0.001 and group != "launch":
                    continue
                kinds = " ".join(f"{k} {v:.3f}" for k, v in sorted(p["kinds"].items()))
                lines.append(
                    f"  {group:15} {p['name']:16} {p['cpu_s']:.3f}  ({kinds}; ended "
                    f"threads {p['ended_threads_s']:.3f})"
                )
                for name, v in list(p["threads"].items())[:top]:
                    if v >= 0.001:
                        lines.append(f"      {name:20} {v:.3f}")
    steps = report.get("push_steps")
    if steps:
        lines.append("")
        lines.append(f"push steps, median ms over {steps['items']} pushes:")
        lines.append("  " + ", ".join(f"{k} {v}" for k, v in steps["median_steps_ms"].items()))
        for item in steps["late"]:
            lines.append(
                f"  late {item['late_ms']} ms after the ask, asked {item['slack_ms']} ms "
                "before it: " + ", ".join(f"{k} {v}" for k, v in item["steps_ms"].items())
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--no-push", action="store_true")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--model-dir", default=os.path.join(tempfile.gettempdir(), "ecshare-wide-qwen2vl")
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="log each push's steps in both instances (adds a thread to each; CPU "
        "figures are then not the plain ones)",
    )
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--keep", action="store_true", help="keep launch's workdir (logs)")
    args = parser.parse_args(argv)
    report = run(args)
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
