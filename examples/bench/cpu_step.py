#!/usr/bin/env python3
"""CPU step-time check: ddp against zero1/zero2/zero3 on 2 gloo ranks, same model, data and optimizer.

Each (strategy, round) is one gpt_bench.py process with ``--accelerator cpu --devices 2 --precision 32-true``
(Lightning starts the second rank), one torch thread per rank by default. Rounds run the strategies in turn
(ddp, zero1, zero2, zero3, ddp, ...) so that drift on a shared machine hits them alike; a strategy's figure is
the median of all its timed steps over all rounds. Strategies that are not registered (lightning_zero missing
or incomplete) are skipped with a message. Target: zero2 <= 1.15x ddp.

usage: python examples/bench/cpu_step.py [--strategies ddp,zero1,zero2,zero3] [--rounds 2] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

from bench_out import out_dir

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "gpt_bench.py")


def registered(py: str) -> tuple[set[str], str]:
    out = subprocess.run([py, BENCH, "--env"], capture_output=True, text=True, timeout=120)
    for line in out.stdout.splitlines():
        if line.startswith("ENV "):
            env = json.loads(line[4:])
            return set(env.get("strategies", [])), str(env.get("lightning_zero"))
    return set(), f"gpt_bench.py --env failed: {out.stderr.strip()[-300:]}"


def run(py: str, strategy: str, a: argparse.Namespace, round_no: int, timeout: float) -> dict:
    cmd = [py, BENCH, "--strategy", strategy, "--accelerator", "cpu", "--devices", str(a.ranks),
           "--precision", "32-true", "--threads", str(a.threads), "--layers", str(a.layers),
           "--d-model", str(a.d_model), "--heads", str(a.heads), "--seq", str(a.seq), "--batch", str(a.batch),
           "--vocab", str(a.vocab), "--warmup", str(a.warmup), "--steps", str(a.steps),
           "--tag", f"cpu_step {strategy} r{round_no}"]
    cmd += [z for kv in a.zero for z in ("--zero", kv)] if strategy.startswith("zero") else []
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # its own group: rank 1 is killed with it on timeout
    rec: dict = {}
    try:
        text, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(10)
                break
            except subprocess.TimeoutExpired:
                continue
        text, err = proc.communicate()
        rec = {"status": "timeout", "error": f"timed out after {timeout:.0f}s"}
    for line in text.splitlines():
        if line.startswith("RESULT "):
            rec = json.loads(line[7:])
    if not rec:
        tail = (text + err).strip().splitlines()[-3:]
        rec = {"status": "fail", "error": f"rc={proc.returncode}, no RESULT: {' / '.join(tail)}"}
    if a.log:
        with open(a.log, "a") as f:
            f.write(f"==== {' '.join(cmd)}\n{text}\n{err}\n")
    rec["run_s"] = round(time.time() - t0, 1)
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategies", default="ddp,zero1,zero2,zero3", help="comma list; the first is the baseline")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per run")
    ap.add_argument("--zero", action="append", default=[], metavar="KEY=VALUE",
                    help="ZeroConfig override for the zero runs (repeatable)")
    ap.add_argument("--target", type=float, default=1.15, help="zero2 / ddp step-time ratio to meet")
    ap.add_argument("--deadline", type=float, default=290, help="seconds; later runs are skipped")
    ap.add_argument("--timeout", type=float, default=150, help="seconds per run")
    ap.add_argument("--log", default=os.path.join(out_dir(), "cpu_step.log"),
                    help="full output of every run ('' for none)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when zero2 misses the target or fails")
    a = ap.parse_args()
    t0 = time.time()
    py = sys.executable
    names = [s.strip() for s in a.strategies.split(",") if s.strip()]
    known, lz = registered(py)
    todo = []
    for s in names:
        if s == "auto" or s in known:
            todo.append(s)
        else:
            print(f"skip {s}: not a registered Lightning strategy (lightning_zero: {lz})", flush=True)
    print(f"model: {a.layers} layers, d{a.d_model}, {a.heads} heads, seq {a.seq}, micro-batch {a.batch}/rank, "
          f"vocab {a.vocab}; {a.ranks} gloo ranks x {a.threads} thread(s); fp32; AdamW foreach; "
          f"{a.warmup} warm-up + {a.steps} timed steps x {a.rounds} round(s)", flush=True)
    results: dict[str, list[dict]] = {s: [] for s in todo}
    for r in range(a.rounds):
        for s in todo:
            left = a.deadline - (time.time() - t0)
            if left < 30:
                print(f"skip {s} round {r + 1}: deadline ({left:.0f}s left)", flush=True)
                continue
            rec = run(py, s, a, r + 1, min(a.timeout, left - 5))
            results[s].append(rec)
            msg = (f"median {rec['step_s_median']:.3f} s, steps {rec.get('step_s_all')}" if rec.get("status") == "ok"
                   else f"{rec.get('status')}: {rec.get('error')}")
            print(f"[{time.time() - t0:5.0f}s] {s} round {r + 1}: {msg} ({rec['run_s']} s)", flush=True)

    summary = {}
    for s, recs in results.items():
        ok = [x for x in recs if x.get("status") == "ok"]
        steps = [t for x in ok for t in x.get("step_s_all", [])]
        if not steps:
            errors = "; ".join(str(x.get("error")) for x in recs) or "no run"
            summary[s] = {"status": "fail", "error": errors[:300]}
            continue
        summary[s] = {"status": "ok", "median": statistics.median(steps), "min": min(steps), "max": max(steps),
                      "round_medians": [x["step_s_median"] for x in ok], "runs": len(ok),
                      "tokens_per_s": a.batch * a.seq * a.ranks / statistics.median(steps),
                      "rss_gib": max(x.get("host_peak_rss_gib", 0) for x in ok),
                      "memory_report": ok[-1].get("memory_report")}
    base_name = todo[0] if todo else None
    base = summary.get(base_name, {}).get("median") if base_name else None
    print(f"\n| strategy | step s median (min-max) | vs {base_name} | tok/s | round medians | rank-0 peak RSS GiB |")
    print("|---|---|---|---|---|---|")
    for s, v in summary.items():
        if v["status"] != "ok":
            print(f"| {s} | failed | — | — | — | — |  {v['error']}")
            continue
        ratio = f"{v['median'] / base:.3f}x" if base else "—"
        v["ratio"] = round(v["median"] / base, 4) if base else None
        rounds = ", ".join(f"{m:.3f}" for m in v["round_medians"])
        print(f"| {s} | {v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f}) | {ratio} | {v['tokens_per_s']:.0f} | "
              f"{rounds} | {v['rss_gib']:.2f} |")
    for s, v in summary.items():
        if v.get("memory_report"):
            print(f"memory_report {s}: {json.dumps(v['memory_report'])}")
    verdict = None
    z2 = summary.get("zero2", {})
    if base and z2.get("status") == "ok" and base_name == "ddp":
        verdict = z2["ratio"] <= a.target
        print(f"\nzero2 / ddp = {z2['ratio']:.3f} (target <= {a.target}): {'PASS' if verdict else 'MISS'}")
    elif "zero2" in names:
        print("\nzero2 / ddp: not measured")
    print("CPU_STEP " + json.dumps({"summary": {k: {kk: vv for kk, vv in v.items() if kk != "memory_report"}
                                                for k, v in summary.items()},
                                    "target": a.target, "pass": verdict, "wall_s": round(time.time() - t0, 1)}),
          flush=True)
    if a.strict and verdict is not True:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
