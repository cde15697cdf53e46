"""Plots of the recorded benchmark figures, for the docs: ``python -m bench.plots``.

Reads every JSON line recorded in `bench/RESULTS.md` and `bench/history/*.md` (each one a
benchmark's printed result) and writes PNGs to `docs/img/` (``--out`` elsewhere):

- ``gpu_step_vs_limit.png``: GPU decode step time against the physical limit (the weight sweep:
  every weight read once) by batch size. It reads ``step_ms_by_batch_<shape>`` and
  ``limit_ms_by_batch_<shape>`` (batch size -> ms) from `bench.gpu`; until a batch sweep is
  recorded it plots the batch-1 8B pair every `bench.gpu` run has (``b1_decode_ms_8b``,
  ``weight_sweep_ms_8b``) and says on the plot that the sweep is missing.
- ``throughput_vs_transformers.png``: Baton vs transformers tokens per second (CPU, SmolLM2;
  GPU, the Llama-3.2-1B shape).
- ``kv_transfer_vs_tcp.png``: KV-transfer rate against raw TCP for every recorded run and case.
- ``scheduler_cost.png``: scheduler CPU time per sequence per step against running sequences.
- ``autoscaler_reaction.png``: crossing -> decision and crossing -> replicas patched, against
  the target.
- ``pd_vs_aggregated.png``: `bench.pd`'s goodput under its SLO and ITL p99 of the P/D layout and
  the aggregated one by offered rate (the current record; its ``figure`` note says whether it is
  the two-GPU figure or a CPU shape check).

Each plot says what data it lacks instead of inventing it. Prints one JSON object (what was
drawn from how many records, what is missing) as the last line.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "RESULTS.md"
SOURCES = [*sorted((REPO / "bench" / "history").glob("*.md")), RESULTS]  # oldest records first
OUT = REPO / "docs" / "img"

Record = dict[str, Any]


def bench_of(record: Record) -> str | None:
    """Which benchmark printed a record (older records lack the ``bench`` key)."""
    name = record.get("bench") or record.get("benchmark")
    if name:
        return str(name)
    if "us_per_seq_step" in record:
        return "scheduler"
    if "weight_sweep_ms_8b" in record or "baton_tokens_per_s_1b" in record:
        return "gpu"
    if "apply_to_children_p99_s" in record:
        return "operator"
    if "warm_up_s" in record:
        return "cluster"
    return None


CURRENT = "_current"  # set on records that bench/RESULTS.md shows as the latest figures


def load_records(sources: list[Path] = SOURCES) -> dict[str, list[Record]]:
    """Every distinct JSON line of the sources, by benchmark, oldest first (quick runs skipped);
    those that the last source (`bench/RESULTS.md`) shows carry ``CURRENT``."""
    seen: dict[str, Record] = {}
    by_bench: dict[str, list[Record]] = {}
    for index, path in enumerate(sources):
        for line in path.read_text().splitlines():
            line = line.strip()
            if not line.startswith("{"):
                continue
            if line in seen:
                seen[line][CURRENT] = index == len(sources) - 1
                continue
            record = json.loads(line)
            record[CURRENT] = index == len(sources) - 1
            seen[line] = record
            name = bench_of(record)
            if name is None or record.get("quick") is True:
                continue
            by_bench.setdefault(name, []).append(record)
    return by_bench


def latest(records: list[Record]) -> Record:
    """The record bench/RESULTS.md shows as current, else the newest one."""
    current = [r for r in records if r.get(CURRENT)]
    return (current or records)[-1]


def _note(ax: Any, text: str) -> None:
    ax.text(
        0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=9, color="0.4", wrap=True
    )


def gpu_step_vs_limit(records: dict[str, list[Record]], ax: Any) -> dict[str, Any]:
    runs = records.get("gpu", [])
    sweeps = [r for r in runs if any(k.startswith("step_ms_by_batch_") for k in r)]
    if sweeps:
        newest = latest(sweeps)
        for key in sorted(k for k in newest if k.startswith("step_ms_by_batch_")):
            shape = key.removeprefix("step_ms_by_batch_")
            step = {int(b): float(v) for b, v in newest[key].items()}
            limit = {int(b): float(v) for b, v in newest.get(f"limit_ms_by_batch_{shape}", {}).items()}
            ax.plot(sorted(step), [step[b] for b in sorted(step)], "o-", label=f"Baton step, {shape}")
            if limit:
                ax.plot(
                    sorted(limit), [limit[b] for b in sorted(limit)], "k--", label=f"physical limit, {shape}"
                )
        ax.set_xscale("log", base=2)
        missing = []
    else:
        pairs = [r for r in runs if "b1_decode_ms_8b" in r and "weight_sweep_ms_8b" in r]
        if not pairs:
            _note(ax, "no bench.gpu run recorded")
            return {"records": 0, "missing": ["bench.gpu runs"]}
        newest = latest(pairs)
        ax.bar(
            ["Baton decode step", "weight sweep (limit)"],
            [newest["b1_decode_ms_8b"], newest["weight_sweep_ms_8b"]],
        )
        for x, ms in enumerate((newest["b1_decode_ms_8b"], newest["weight_sweep_ms_8b"])):
            ax.text(x, ms, f"{ms:.2f} ms", ha="center", va="bottom")
        ax.set_xlabel("Llama-3.1-8B shape, batch 1, bf16 (a batch-size sweep is not recorded yet)")
        missing = ["step_ms_by_batch_* / limit_ms_by_batch_* (a batch-size sweep of bench.gpu)"]
        sweeps = pairs
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"GPU decode step vs physical limit ({newest.get('gpu', 'GPU')})")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    return {"records": len(sweeps), "missing": missing}


def throughput_vs_transformers(records: dict[str, list[Record]], ax: Any) -> dict[str, Any]:
    groups: list[tuple[str, float, float]] = []
    cpu = [r for r in records.get("cpu_throughput", []) if "hf_tokens_per_s" in r]
    if cpu:
        r = latest(cpu)
        groups.append(("CPU, SmolLM2-135M\n(2 cores)", r["baton_tokens_per_s"], r["hf_tokens_per_s"]))
    gpu = [r for r in records.get("gpu", []) if "hf_tokens_per_s_1b" in r]
    if gpu:
        r = latest(gpu)
        groups.append(
            (
                f"GPU, Llama-3.2-1B shape\n({r.get('gpu', 'GPU')})",
                r["baton_tokens_per_s_1b"],
                r["hf_tokens_per_s_1b"],
            )
        )
    if not groups:
        _note(ax, "no throughput run recorded")
        return {"records": 0, "missing": ["bench.cpu_throughput / bench.gpu runs"]}
    xs = range(len(groups))
    ax.bar([x - 0.2 for x in xs], [g[1] for g in groups], 0.4, label="Baton")
    ax.bar([x + 0.2 for x in xs], [g[2] for g in groups], 0.4, label="transformers generate()")
    for x, (_, baton, hf) in zip(xs, groups, strict=True):
        ax.text(x, max(baton, hf), f"{baton / hf:.1f}x", ha="center", va="bottom")
    ax.set_xticks(list(xs), [g[0] for g in groups])
    ax.set_yscale("log")
    ax.set_ylabel("output tokens per second (log)")
    ax.set_title("Throughput vs transformers, same weights")
    ax.legend()
    return {"records": len(cpu) + len(gpu), "missing": []}


def kv_transfer_vs_tcp(records: dict[str, list[Record]], ax: Any) -> dict[str, Any]:
    runs = [r for r in records.get("kv_transfer", []) if "cases" in r]
    if not runs:
        _note(ax, "no bench.kv_transfer run recorded")
        return {"records": 0, "missing": ["bench.kv_transfer runs"]}
    labels, baton, raw = [], [], []
    for i, run in enumerate(runs, 1):
        for case, figures in run["cases"].items():
            now = " (current)" if run.get(CURRENT) else ""
            labels.append(f"run {i}, {run.get('device', 'cpu')} caches{now}\n{case}")
            baton.append(figures["baton_gb_per_s"])
            raw.append(figures["raw_tcp_gb_per_s"])
    ys = range(len(labels))
    ax.barh([y - 0.2 for y in ys], baton, 0.4, label="Baton KV pull")
    ax.barh([y + 0.2 for y in ys], raw, 0.4, label="raw TCP, same bytes")
    ax.set_yticks(list(ys), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s")
    ax.set_title("KV transfer vs raw TCP (target: 0.70 of raw)")
    ax.legend()
    return {"records": len(runs), "missing": []}


def scheduler_cost(records: dict[str, list[Record]], ax: Any) -> dict[str, Any]:
    runs = [r for r in records.get("scheduler", []) if "cpu_us_per_seq_step" in r]
    if not runs:
        _note(ax, "no bench.scheduler run recorded")
        return {"records": 0, "missing": ["bench.scheduler runs"]}
    for i, run in enumerate(runs, 1):
        cost = {int(n): v for n, v in run["cpu_us_per_seq_step"].items()}
        load = run.get("config", {}).get("load_average_1m", ["?"])[-1]
        now = ", current" if run.get(CURRENT) else ""
        ax.plot(sorted(cost), [cost[n] for n in sorted(cost)], "o-", label=f"run {i} (load {load}{now})")
    ax.axhline(1.0, color="k", linestyle="--", label="target 1.0 µs")
    ax.set_xscale("log", base=2)
    sizes = sorted({int(n) for run in runs for n in run["cpu_us_per_seq_step"]})
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_xlabel("running sequences N")
    ax.set_ylabel("CPU µs per sequence per step")
    ax.set_title("Scheduler cost vs sequences (schedule + postprocess)")
    ax.legend(fontsize=8)
    return {"records": len(runs), "missing": []}


def autoscaler_reaction(records: dict[str, list[Record]], ax: Any) -> dict[str, Any]:
    runs = [r for r in records.get("autoscaler", []) if r.get("reaction_s") is not None]
    if not runs:
        _note(ax, "no bench.autoscaler run with reaction_s recorded")
        return {"records": 0, "missing": ["bench.autoscaler reaction_s"]}
    r = latest(runs)
    names = ["crossing -> decision\n(in-process loop)", "crossing -> replicas patched\n(operator process)"]
    means = [r["decision_reaction_s_mean"], r["reaction_s_mean"]]
    worst = [r["decision_reaction_s_max"], r["reaction_s"]]
    ax.bar([0 - 0.2, 1 - 0.2], means, 0.4, label="mean")
    ax.bar([0 + 0.2, 1 + 0.2], worst, 0.4, label="worst")
    ax.axhline(r["reaction_target_s"], color="k", linestyle="--", label=f"target {r['reaction_target_s']} s")
    ax.set_xticks([0, 1], names)
    ax.set_ylabel("seconds")
    ax.set_title(f"Autoscaler reaction, intervalSeconds {r['interval_s']} ({r['reaction_trials']} trials)")
    ax.legend()
    return {"records": len(runs), "missing": ["per-trial reaction times (only mean and worst are recorded)"]}


def pd_vs_aggregated(records: dict[str, list[Record]], ax: Any) -> dict[str, Any]:
    runs = [r for r in records.get("pd", []) if "rates" in r]
    if not runs:
        _note(ax, "no bench.pd run recorded")
        return {"records": 0, "missing": ["bench.pd runs"]}
    r = latest(runs)
    rates = sorted(r["rates"], key=float)
    xs = [float(x) for x in rates]
    itl = ax.twinx()
    # P/D drawn wider underneath: equal goodputs (both 1.0) stay visible as two lines.
    for layout, color, width in (("disaggregated", "C0", 4.0), ("aggregated", "C1", 1.5)):
        if not all(layout in r["rates"][x] for x in rates):
            continue
        figures = [r["rates"][x][layout] for x in rates]
        goodput = [f["goodput_fraction"] for f in figures]
        ax.plot(xs, goodput, "o-", color=color, linewidth=width, label=f"{layout}: goodput")
        itl.plot(xs, [f["itl_p99_ms"] for f in figures], "s--", color=color, label=f"{layout}: ITL p99")
    slo = r["slo"]
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("offered load, requests/s (Poisson)")
    ax.set_ylabel(f"goodput fraction (TTFT <= {slo['ttft_s']} s, ITL <= {slo['itl_ms']} ms)")
    itl.set_ylim(bottom=0)
    itl.set_ylabel("ITL p99, ms (dashed)")
    ax.set_title(f"P/D vs aggregated, 2 engines ({r['device']}): {r['figure']}", fontsize=8)
    lines = ax.get_legend_handles_labels()
    more = itl.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="lower left")
    missing = (
        []
        if r["device"] == "cuda" and "share" not in r["figure"]
        else ["the two-GPU run (bench.pd --device cuda)"]
    )
    return {"records": len(runs), "missing": missing}


PLOTS: dict[str, Callable[[dict[str, list[Record]], Any], dict[str, Any]]] = {
    "gpu_step_vs_limit": gpu_step_vs_limit,
    "throughput_vs_transformers": throughput_vs_transformers,
    "kv_transfer_vs_tcp": kv_transfer_vs_tcp,
    "scheduler_cost": scheduler_cost,
    "autoscaler_reaction": autoscaler_reaction,
    "pd_vs_aggregated": pd_vs_aggregated,
}


def draw(out: Path, sources: list[Path] = SOURCES) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = load_records(sources)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    for name, plot in PLOTS.items():
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
        summary[name] = plot(records, ax)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", metadata={"Software": None})
        plt.close(fig)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.plots", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="folder for the PNGs (default: docs/img)")
    args = parser.parse_args()
    summary = draw(args.out)
    print(json.dumps({"plots": summary, "out": str(args.out)}))


if __name__ == "__main__":
    main()
