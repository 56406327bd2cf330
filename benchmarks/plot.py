"""Figures for the docs, from benchmark JSON (and one explanatory figure that needs no data).

    python benchmarks/ttft.py --json > ttft.json
    python benchmarks/plot.py --ttft ttft.json           # writes docs/img/ttft.png
    python benchmarks/plot.py --concepts                 # writes docs/img/attention.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "img"


def plot_ttft(path: Path) -> Path:
    data = json.loads(path.read_text())
    rows = data["results"]
    labels = [f"{r['context_tokens']} tokens" for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    x = range(len(rows))
    bars = [("full_s", None, "full prefill"),
            ("turbo_s", "speedup", f"TurboRAG, the default ({rows[0].get('recovery', '')})"),
            ("stitched_s", "stitched_speedup", "stitched alone (recovery none)")]
    bars = [b for b in bars if all(b[0] in r for r in rows)]
    width = 0.8 / len(bars)
    for j, (key, ratio, label) in enumerate(bars):
        offset = (j - (len(bars) - 1) / 2) * width
        ax.bar([i + offset for i in x], [r[key] for r in rows], width, label=label)
        for i, r in zip(x, rows):
            if ratio:
                ax.text(i + offset, r[key], f"{r[ratio]:.1f}x", ha="center", va="bottom")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"TTFT, {data['model']} ({data.get('dtype', '')}), median of runs")
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    out = OUT / "ttft.png"
    fig.savefig(out, dpi=120)
    return out


def plot_concepts() -> Path:
    """The independent-attention mask and the two position layouts of one small prompt."""
    import torch

    from turborag_integrations.core.prefill.stitch import independent_attention_mask

    parts = [("sys", 2, False), ("chunk A", 4, True), ("glue", 1, False), ("chunk B", 3, True),
             ("question", 3, False)]
    spans, start = [], 0
    for _, n, cached in parts:
        if cached:
            spans.append((start, n))
        start += n
    mask = independent_attention_mask(start, spans).to(torch.float32)
    positions = list(range(start))  # every token at its index: chunk keys re-rotated there
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 4), gridspec_kw={"width_ratios": [1.1, 1]})
    a.imshow(mask, cmap="Blues", vmin=0, vmax=1.3)
    a.set_title("who attends to whom (row → columns)")
    ticks = [i for i in range(start)]
    names = [name for name, n, _ in parts for _ in range(n)]
    a.set_xticks(ticks, names, rotation=90, fontsize=7)
    a.set_yticks(ticks, names, fontsize=7)
    b.axis("off")
    b.set_title("positions")
    rows = [["token"] + names, ["position"] + positions]
    table = b.table(cellText=[list(map(str, r)) for r in zip(*rows)], loc="center")
    table.auto_set_font_size(False)
    table.set_fontsize(7)
    fig.tight_layout()
    out = OUT / "attention.png"
    fig.savefig(out, dpi=120)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ttft", type=Path, help="JSON from benchmarks/ttft.py --json")
    ap.add_argument("--concepts", action="store_true", help="the attention/positions figure")
    args = ap.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    if args.ttft:
        print(plot_ttft(args.ttft))
    if args.concepts:
        print(plot_concepts())
    if not (args.ttft or args.concepts):
        ap.error("nothing to plot: give --ttft FILE and/or --concepts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
