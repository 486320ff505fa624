#!/usr/bin/env python3
"""Run named lists of gpt_bench.py configurations, one process each, within a wall-clock deadline.

usage: python examples/bench/suite.py SUITE [SUITE ...] [--deadline S] [--devices N] [--only TEXT] [--extra "ARGS"]

Suites: zero13 (1.3B on one GPU: auto, fsdp2, deepspeed_stage_2/3, zero1/2/3), zero13_ckpt, zero27,
smoke (tiny model on the CPU, 1 and 2 gloo ranks), selftest (smoke plus runs that must fail).
Runs whose strategy cannot work here (deepspeed not importable, a zero name that lightning_zero does not
register) are recorded as skipped; a run that crashes or times out is recorded as failed and the suite
goes on. Every run appends a JSON line to $OUT/results.jsonl (./ when OUT is unset); the suite adds the
failed/skipped ones, keeps the full output in $OUT/log.txt and writes the final table to $OUT/table.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

from bench_out import out_dir

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "gpt_bench.py")
OUT = out_dir()

M13 = ["--layers", "24", "--d-model", "2048", "--heads", "16", "--seq", "2048", "--batch", "8"]
M27 = ["--layers", "32", "--d-model", "2560", "--heads", "20", "--seq", "2048", "--batch", "8"]
TINY = ["--accelerator", "cpu", "--layers", "2", "--d-model", "64", "--heads", "4", "--seq", "32", "--batch", "2",
        "--vocab", "1024", "--warmup", "1", "--steps", "3"]


def _gpu_suite(prefix: str, shape: list[str], strategies: list[tuple[str, list[str]]], timeout: int,
               extra: list[str] | None = None) -> list[dict]:
    """One run per (name, [strategy, more args...]) with the model shape and extra args appended."""
    return [{"tag": f"{prefix} {name}", "args": ["--strategy", *spec] + shape + (extra or []), "timeout": timeout,
             "gpu": True} for name, spec in strategies]


ONE_GPU = [("auto", ["auto"]), ("fsdp2", ["fsdp2", "--precision", "32-true"]), ("ds2", ["deepspeed_stage_2"]),
           ("ds3", ["deepspeed_stage_3"]), ("zero1", ["zero1"]), ("zero2", ["zero2"]), ("zero3", ["zero3"])]

SUITES: dict[str, list[dict]] = {
    # The anchors' 1.3B setting (NOTES.md "Results" and "Third call"), beside ours.
    "zero13": _gpu_suite("1.3B", M13, ONE_GPU, 180),
    "zero13_ckpt": _gpu_suite("1.3B ckpt", M13, ONE_GPU, 200, ["--ckpt"]),
    "zero27": _gpu_suite("2.7B", M27, [s for s in ONE_GPU if s[0] in ("auto", "fsdp2", "zero2", "zero3")], 240),
    "smoke": [
        {"tag": "smoke auto", "args": ["--strategy", "auto"] + TINY, "timeout": 90},
        {"tag": "smoke ddp x2", "args": ["--strategy", "ddp", "--devices", "2"] + TINY, "timeout": 120},
        {"tag": "smoke zero1 x2", "args": ["--strategy", "zero1", "--devices", "2"] + TINY, "timeout": 120},
        {"tag": "smoke zero2 x2", "args": ["--strategy", "zero2", "--devices", "2"] + TINY, "timeout": 120},
        {"tag": "smoke zero3 x2", "args": ["--strategy", "zero3", "--devices", "2"] + TINY, "timeout": 120},
    ],
}
SUITES["selftest"] = SUITES["smoke"][:2] + [
    {"tag": "selftest unknown strategy (must fail)", "args": ["--strategy", "no_such_strategy"] + TINY,
     "timeout": 60},
    {"tag": "selftest bad shape (must fail)", "args": ["--strategy", "auto"] + TINY + ["--heads", "3"],
     "timeout": 60},
    {"tag": "selftest timeout (must time out)", "args": ["--strategy", "auto"] + TINY + ["--steps", "100000"],
     "timeout": 15},
    {"tag": "selftest deepspeed (skipped without deepspeed)", "args": ["--strategy", "deepspeed_stage_2"] + TINY,
     "timeout": 60},
]

BUILTIN = {"auto", "single", "fsdp2"}


class Log:
    def __init__(self, path: str):
        self.f = open(path, "a", buffering=1)

    def raw(self, text: str) -> None:
        self.f.write(text)

    def __call__(self, msg: str) -> None:
        line = f"[suite {time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.f.write(line + "\n")


def append_result(rec: dict) -> None:
    with open(os.path.join(OUT, "results.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")


def run_one(cmd: list[str], timeout: float, log: Log) -> tuple[int, dict | None, str]:
    """Run cmd in its own session (a multi-rank run's children die with it on timeout); stream its
    output to the log. Returns (rc, the RESULT record or None, the last error-looking line)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)
    seen: dict = {"result": None, "err": ""}

    def reader() -> None:
        for line in proc.stdout:
            log.raw(line)
            if line.startswith("RESULT "):
                try:
                    seen["result"] = json.loads(line[len("RESULT "):])
                except json.JSONDecodeError:
                    seen["err"] = "unparsable RESULT line"
            elif "Error" in line or "error" in line or "Killed" in line:
                seen["err"] = line.strip()[:300]

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        rc = 124
        seen["err"] = f"timeout after {timeout:.0f}s; last error line: {seen['err']}"
    th.join(5)
    return rc, seen["result"], seen["err"]


def probe_env(py: str, log: Log) -> dict:
    out = subprocess.run([py, BENCH, "--env"], capture_output=True, text=True, timeout=300)
    env = {}
    for line in out.stdout.splitlines():
        if line.startswith("ENV "):
            env = json.loads(line[4:])
    log("ENV " + json.dumps(env) + (f" | rc={out.returncode} {out.stderr.strip()[-500:]}" if out.returncode else ""))
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=60)
        log("nvidia-smi: " + (smi.stdout.strip() or smi.stderr.strip()))
    except (OSError, subprocess.SubprocessError) as e:
        log(f"nvidia-smi: {e}")
    return env


def why_skip(args: list[str], env: dict) -> str | None:
    strategy = args[args.index("--strategy") + 1] if "--strategy" in args else "auto"
    if strategy.startswith("deepspeed") and str(env.get("deepspeed", "unavailable")).startswith("unavailable"):
        return f"deepspeed not importable ({env.get('deepspeed')})"
    if strategy in BUILTIN or strategy in env.get("strategies", []):
        return None
    if strategy.startswith("zero"):
        return f"strategy {strategy!r} not registered (lightning_zero: {env.get('lightning_zero')})"
    return None  # unknown names run, and fail with the bench's own message


def fmt(value, spec: str = "") -> str:
    if value is None:
        return "—"
    return format(value, spec) if spec else str(value)


def num(value) -> str:
    if value is None:
        return "—"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"


def table(rows: list[dict]) -> str:
    """Markdown table; 'vs auto' divides by the auto (else ddp) run of the same shape and devices."""
    def key(r: dict) -> tuple:
        return tuple(r.get(k) for k in ("layers", "d_model", "heads", "seq", "micro_batch", "devices", "accelerator",
                                        "ckpt"))

    base: dict[tuple, float] = {}
    for pref in ("auto", "ddp"):
        for r in rows:
            if r.get("strategy") == pref and r.get("status") == "ok" and key(r) not in base:
                base[key(r)] = r.get("tokens_per_s")
    lines = ["| run | strategy | status | params | dev | tok/s | vs auto | TFLOP/s | MFU | GPU peak alloc / resv GiB | "
             "host RSS GiB | step s median (min-max) | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tps, b = r.get("tokens_per_s"), base.get(key(r))
        ratio = f"{tps / b:.3f}x" if (tps and b and r.get("status") == "ok") else "—"
        mem = (f"{fmt(r.get('gpu_peak_alloc_gib'), '.2f')} / {fmt(r.get('gpu_peak_reserved_gib'), '.2f')}"
               if r.get("gpu_peak_alloc_gib") is not None else "—")
        step = (f"{r['step_s_median']:.3f} ({r['step_s_min']:.3f}-{r['step_s_max']:.3f})"
                if r.get("step_s_median") is not None else "—")
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "—"
        note = str(r.get("error", "")).replace("|", "/")[:140]
        n = r.get("params")
        params = "—" if n is None else (f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.1f}M")
        lines.append(f"| {r.get('tag')} | {r.get('strategy', '—')} | {r.get('status')} | {params} | "
                     f"{fmt(r.get('world_size', r.get('devices')))} | {fmt(tps, ',.1f')} | {ratio} | "
                     f"{num(r.get('tflops'))} | {mfu} | {mem} | {fmt(r.get('host_peak_rss_gib'), '.2f')} | "
                     f"{step} | {note} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("suites", nargs="+", help=f"one or more of: {', '.join(SUITES)}")
    ap.add_argument("--deadline", type=float, default=540, help="seconds for the whole suite")
    ap.add_argument("--min-start", type=float, default=45, help="do not start a run with fewer seconds left")
    ap.add_argument("--devices", type=int, default=0, help="append --devices N to every GPU run")
    ap.add_argument("--only", default="", help="comma list: keep runs whose tag contains one of these")
    ap.add_argument("--extra", default="", help="arguments appended to every run, e.g. \"--steps 20\"")
    a = ap.parse_args()
    unknown = [s for s in a.suites if s not in SUITES]
    if unknown:
        ap.error(f"unknown suite(s) {unknown}; known: {', '.join(SUITES)}")
    os.makedirs(OUT, exist_ok=True)
    log = Log(os.path.join(OUT, "log.txt"))
    t0 = time.time()
    py = sys.executable
    env = probe_env(py, log)
    runs = [r for s in a.suites for r in SUITES[s]]
    if a.only:
        keys = [k.strip() for k in a.only.split(",") if k.strip()]
        runs = [r for r in runs if any(k in r["tag"] for k in keys)]
    rows: list[dict] = []
    for run in runs:
        args = list(run["args"])
        if a.devices and run.get("gpu"):
            args += ["--devices", str(a.devices)]
        args += shlex.split(a.extra)
        tag = run["tag"] + (f" x{a.devices}" if a.devices and run.get("gpu") else "")
        skip = why_skip(args, env)
        left = a.deadline - (time.time() - t0)
        if skip is None and left < min(a.min_start, run["timeout"]):
            skip = f"suite deadline ({left:.0f}s left)"
        if skip:
            log(f"SKIP {tag}: {skip}")
            rec = {"tag": tag, "argv": args, "status": "skipped", "error": skip}
            append_result(rec)
            rows.append(rec)
            continue
        timeout = max(5.0, min(run["timeout"], left - 5))
        cmd = [py, BENCH, "--tag", tag] + args
        log(f"RUN {tag} (timeout {timeout:.0f}s): {shlex.join(cmd[1:])}")
        t1 = time.time()
        rc, rec, err = run_one(cmd, timeout, log)
        if rec is None:  # crashed or timed out before printing its result
            rec = {"tag": tag, "argv": args, "status": "timeout" if rc == 124 else "fail", "rc": rc, "error": err}
            append_result(rec)
        elif rc == 124:  # killed after it printed (a partial RESULT on SIGTERM, or a hang in teardown)
            rec["error"] = (rec.get("error", "") + f" (killed by the suite's timeout of {timeout:.0f}s)").strip()
            if rec.get("status") != "ok":
                rec["status"] = "timeout"
        summary = (f"{rec.get('tokens_per_s')} tok/s, step {rec.get('step_s_median')} s" if rec.get("status") == "ok"
                   else rec.get("error", ""))
        log(f"END {tag} rc={rc} {rec.get('status')} in {time.time() - t1:.0f}s: {summary}")
        rows.append(rec)
    log(f"suite done in {time.time() - t0:.0f}s")
    text = table(rows)
    with open(os.path.join(OUT, "table.md"), "a") as f:
        f.write(f"\n<!-- {time.strftime('%Y-%m-%d %H:%M:%S')} suites: {' '.join(a.suites)} -->\n{text}\n")
    print("\n" + text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
