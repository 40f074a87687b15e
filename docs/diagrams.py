"""Draw img/fsdp.png and img/rsdp.png: what FSDP and RSDP hold and send for one layer on 4 ranks.

    python docs/diagrams.py [--out img]

Every panel shows the ranks as rows and the layer's weight as its 4 row-shards (one column each, one
colour each). A solid cell is a weight shard the rank holds, a hatched cell a gradient (partial) sum, a
dotted outline a shard the rank does not hold.
"""

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

WORLD = 4
SHARD_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52")
CELL = 0.8  # cell size; shards are one unit apart
RIGHT_EDGE = WORLD - 1 + CELL  # x where the last shard column ends; messages are drawn right of it


def rank_row(rank: int) -> float:
    """Rank 0 on top."""
    return WORLD - 1 - rank


def new_panel(axis, title: str) -> None:
    # Room on the right for the ring's messages and their labels, or for the arrow to the next panel.
    axis.set_xlim(-1.3, WORLD + 2.3)
    axis.set_ylim(-0.8, WORLD + 0.1)
    axis.set_aspect("equal")
    axis.axis("off")
    axis.set_title(title, fontsize=10)
    for rank in range(WORLD):
        axis.text(-0.2, rank_row(rank) + CELL / 2, f"rank {rank}", ha="right", va="center", fontsize=9)
        for shard in range(WORLD):
            axis.add_patch(
                Rectangle((shard, rank_row(rank)), CELL, CELL, fill=False, linestyle=":", edgecolor="0.6")
            )
    for shard in range(WORLD):
        axis.text(shard + CELL / 2, -0.4, f"W{shard}", ha="center", va="center", fontsize=8, color="0.4")


def weight(axis, rank: int, shard: int, alpha: float = 1.0) -> None:
    axis.add_patch(
        Rectangle(
            (shard, rank_row(rank)), CELL, CELL, facecolor=SHARD_COLORS[shard], edgecolor="black", alpha=alpha
        )
    )


def gradient(axis, rank: int, shard: int, label: str) -> None:
    """A gradient sum for ``shard`` held by ``rank``; ``label`` says how many ranks it sums."""
    axis.add_patch(
        Rectangle(
            (shard, rank_row(rank)),
            CELL,
            CELL,
            facecolor="white",
            edgecolor=SHARD_COLORS[shard],
            hatch="////",
            linewidth=2,
        )
    )
    axis.text(
        shard + CELL / 2,
        rank_row(rank) + CELL / 2,
        label,
        ha="center",
        va="center",
        fontsize=8,
        bbox={"facecolor": "white", "edgecolor": "none", "pad": 1},
    )


def ring_arrow(axis, sender: int, receiver: int, label: str, color: str) -> None:
    """A message between two ranks, drawn as an arc right of the shards. The wrap-around message
    (between rank 0 and rank W-1) bulges further out than the neighbour ones so that none overlap."""
    x = RIGHT_EDGE + 0.1
    start, end = (x, rank_row(sender) + CELL / 2), (x, rank_row(receiver) + CELL / 2)
    wraps = abs(sender - receiver) != 1
    bend = 0.7 if wraps else 0.35
    # A positive arc3 radius bulges to the right of the direction of travel: right for upward messages,
    # left for downward ones, which therefore get a negative radius.
    rad = bend if end[1] > start[1] else -bend
    axis.add_patch(
        FancyArrowPatch(
            start,
            end,
            connectionstyle=f"arc3,rad={rad}",
            arrowstyle="-|>",
            mutation_scale=10,
            color=color,
            linewidth=1.3,
            linestyle="--" if wraps else "-",
        )
    )
    bulge = bend * abs(end[1] - start[1]) / 2  # a quadratic Bezier reaches half way to its control point
    axis.text(x + bulge + 0.15, (start[1] + end[1]) / 2, label, ha="left", va="center", fontsize=8, color=color)


def to_next_panel(axis, text: str) -> None:
    """An arrow in the panel's right margin, pointing at the next panel."""
    y = WORLD / 2 - 0.1
    axis.annotate(
        "",
        xy=(WORLD + 2.2, y),
        xytext=(RIGHT_EDGE + 0.3, y),
        arrowprops={"arrowstyle": "-|>", "color": "black", "linewidth": 1.5},
    )
    axis.text((RIGHT_EDGE + WORLD + 2.5) / 2, y + 0.15, text, ha="center", va="bottom", fontsize=9)


def draw_fsdp(path: Path) -> None:
    figure, axes = plt.subplots(1, 4, figsize=(16, 4.4), layout="constrained")
    at_rest, gathered, full_gradients, reduced = axes

    new_panel(at_rest, "at rest: rank r stores shard r")
    for rank in range(WORLD):
        weight(at_rest, rank, rank)
    to_next_panel(at_rest, "all-gather")

    new_panel(gathered, "forward, and again in backward:\nevery rank holds the whole layer")
    for rank in range(WORLD):
        for shard in range(WORLD):
            weight(gathered, rank, shard)

    new_panel(full_gradients, "backward: every rank computes a\nfull-size gradient from its own batch")
    for rank in range(WORLD):
        for shard in range(WORLD):
            gradient(full_gradients, rank, shard, "1")
    to_next_panel(full_gradients, "reduce-scatter")

    new_panel(reduced, "rank r keeps shard r of the\ngradient summed over the 4 ranks")
    for rank in range(WORLD):
        gradient(reduced, rank, rank, "Σ4")

    figure.suptitle(
        "FSDP on 4 ranks: all-gather the layer, compute, reduce-scatter its gradient.\n"
        "Peak: the whole layer (plus the prefetched next one) and a full-size gradient on every rank.",
        fontsize=11,
    )
    figure.savefig(path, dpi=110)
    plt.close(figure)


def draw_rsdp(path: Path) -> None:
    figure = plt.figure(figsize=(16, 8.2), layout="constrained")
    weights_row, partials_row = figure.subfigures(2, 1, hspace=0.05)

    weights_row.suptitle(
        "Forward (and again in backward, for the input gradient): weight shards rotate toward rank r-1",
        fontsize=11,
        fontweight="bold",
    )
    for step, axis in enumerate(weights_row.subplots(1, WORLD)):
        new_panel(axis, f"step k={step}: rank r computes with\nshard (r+k) mod {WORLD} and sends it to r-1")
        for rank in range(WORLD):
            weight(axis, rank, rank, alpha=0.25)  # its own shard, which it keeps
            held = (rank + step) % WORLD
            weight(axis, rank, held)
            if step < WORLD - 1:
                ring_arrow(axis, rank, (rank - 1) % WORLD, f"W{held}", "black")

    partials_row.suptitle(
        "Backward: gradient partials travel toward rank r+1, each rank adding its part, until they reach "
        "their owner",
        fontsize=11,
        fontweight="bold",
    )
    for step, axis in enumerate(partials_row.subplots(1, WORLD)):
        new_panel(axis, f"step k={step}: rank r adds its part to the\npartial of shard (r-1-k) mod {WORLD}")
        for rank in range(WORLD):
            target = (rank - 1 - step) % WORLD
            gradient(axis, rank, target, f"Σ{step + 1}")
            if step < WORLD - 1:
                ring_arrow(axis, rank, (rank + 1) % WORLD, f"∂W{target}", "0.3")

    figure.suptitle(
        "RSDP on 4 ranks: no rank ever holds the whole layer or its whole gradient. Peak: 2 weight shards "
        "(forward), 2 weight shards + 2 partials (backward).\nPale: the rank's own shard, kept at rest. Dashed: "
        "the wrap-around message between rank 0 and rank 3. After step 3, rank r holds Σ4 of its own shard.",
        fontsize=11,
    )
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "img")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    draw_fsdp(args.out / "fsdp.png")
    draw_rsdp(args.out / "rsdp.png")
    print(f"wrote {args.out / 'fsdp.png'} and {args.out / 'rsdp.png'}")


if __name__ == "__main__":
    main()
