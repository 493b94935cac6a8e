"""Where the CPU goes during benchmarks/generation.py: per-process CPU and py-spy profiles per phase.

Runs generation.py (the arguments after `--`), watches its stderr for the timed phases it
announces, and during each phase
  - samples every process of the run (the benchmark process, vLLM's EngineCore, the Serve engine
    and gateway replicas, Serve's HTTP proxy) from /proc: CPU seconds used within the phase;
  - with --py-spy, records each of them with py-spy (non-blocking, raw collapsed stacks, per
    thread; with --gil only the samples that hold the GIL) for --spy-s seconds from --spy-delay-s
    after the phase starts.
Writes DIR/generation.log (its stdout) and DIR/generation.err, DIR/profile.json (per phase:
seconds, CPU fraction of each process) and DIR/spy-<phase>-<process>.txt, and prints each
process's top functions by own samples. With several replicas, the first process of each kind.

    python benchmarks/profile_generation.py --out /tmp/prof --py-spy .whl/py-spy -- \\
        --model /tmp/qwen2-0.5b-random --dtype bfloat16 --num-gpus 1 --max-model-len 1024 \\
        --num-prompts 1024 --concurrency 128 --max-tokens 256
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
# process kind -> a pattern of its command line (Ray and vLLM set process titles)
KINDS = {
    "engine_replica": re.compile(r"ServeReplica:[^:]+:GeneratorEngine"),
    "gateway_replica": re.compile(r"ServeReplica:[^:]+:GeneratorGateway"),
    "serve_proxy": re.compile(r"ProxyActor"),
    "engine_core": re.compile(r"EngineCore"),
    "vllm_serve": re.compile(r"entrypoints\.cli\.main|\bvllm serve\b|APIServer"),  # vLLM's own OpenAI server (the comparison)
}
MARK = re.compile(r"^\[generation\] phase (\S+) (start|end) ([0-9.]+)")


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def processes(bench_pid: int) -> dict[str, int]:
    """kind -> pid for the processes of interest now running (the first of each kind)."""
    found = {"benchmark": bench_pid}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        line = cmdline(int(entry))
        for kind, pattern in KINDS.items():
            if kind not in found and pattern.search(line):
                found[kind] = int(entry)
    return found


def top_functions(raw: Path, n: int = 12) -> list[tuple[str, float]]:
    """Functions by share of samples in which they were the innermost Python frame (py-spy raw)."""
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = [f for f in stack.split(";") if not f.startswith(("thread (", "process "))]
        total += int(count)
        own[frames[-1] if frames else "?"] += int(count)
    return [(f, round(c / total, 3)) for f, c in own.most_common(n)] if total else []


class Phase:
    def __init__(self, name: str, bench_pid: int) -> None:
        self.name, self.t0 = name, time.time()
        self.pids = processes(bench_pid)
        self.cpu0 = {k: cpu_seconds(p) for k, p in self.pids.items()}
        self.spies: list[tuple[str, Path, subprocess.Popen]] = []

    def spy(self, py_spy: str, out: Path, seconds: float, rate: int, gil: bool) -> None:
        for kind, pid in self.pids.items():
            path = out / f"spy-{self.name}-{kind}.txt"
            cmd = [py_spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(rate),
                   "--format", "raw", "--nonblocking", "--threads", "--output", str(path), *(["--gil"] if gil else [])]
            self.spies.append((kind, path, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))

    def finish(self) -> dict:
        """The phase's CPU figures, read at once (the next phase may start right after)."""
        seconds = time.time() - self.t0
        cpu = {}
        for kind, pid in self.pids.items():
            c1 = cpu_seconds(pid)
            if c1 is not None and self.cpu0.get(kind) is not None:
                cpu[kind] = round((c1 - self.cpu0[kind]) / seconds, 3)
        return {"phase": self.name, "seconds": round(seconds, 2), "cpu_fraction": cpu, "pids": self.pids, "top": {}}

    def collect(self, row: dict) -> None:
        """Wait for this phase's py-spy recordings and put their top functions into `row`."""
        for kind, path, proc in self.spies:
            try:
                _, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if path.exists():
                row["top"][kind] = top_functions(path)
            else:
                row["top"][kind] = [(f"py-spy failed: {err.decode(errors='replace').strip()[-300:]}", 0.0)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--py-spy", default=None, help="path of a py-spy binary (no profiles without it)")
    ap.add_argument("--spy-delay-s", type=float, default=3.0)
    ap.add_argument("--spy-s", type=float, default=10.0)
    ap.add_argument("--rate", type=int, default=100)
    ap.add_argument("--gil", action="store_true", help="py-spy --gil: only samples of the thread holding the GIL "
                    "(what saturates a process whose Python is the bottleneck)")
    ap.add_argument("generation_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gen_args = [a for a in args.generation_args if a != "--"]
    log = open(out / "generation.err", "w")
    with open(out / "generation.log", "w") as stdout:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("generation.py")), *gen_args],
                                stdout=stdout, stderr=subprocess.PIPE, text=True)
    phases, rows, done = {}, [], []

    def start_spies(phase: Phase) -> None:
        time.sleep(args.spy_delay_s)
        phase.spy(args.py_spy, out, args.spy_s, args.rate, args.gil)

    for line in proc.stderr:
        log.write(line)
        log.flush()  # a run cut short by a timeout keeps its log
        m = MARK.match(line)
        if not m:
            continue
        name, what = m.group(1), m.group(2)
        if what == "start":
            phases[name] = Phase(name, proc.pid)
            if args.py_spy:
                threading.Thread(target=start_spies, args=(phases[name],), daemon=True).start()
        elif name in phases:
            phase = phases.pop(name)
            rows.append(phase.finish())
            done.append(phase)
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "top"}), flush=True)
    rc = proc.wait()
    log.close()
    for phase, row in zip(done, rows):
        phase.collect(row)
    (out / "profile.json").write_text(json.dumps(rows, indent=1))
    for row in rows:
        for kind, top in row["top"].items():
            print(f"== {row['phase']} {kind} (cpu {row['cpu_fraction'].get(kind)})")
            for fn, share in top:
                print(f"  {share:6.3f}  {fn[:160]}")
    print(f"generation.py rc={rc}")
    sys.exit(rc)


if __name__ == "__main__":
    main()
