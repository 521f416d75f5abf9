"""The vlm-tiny task's data (issue 71): count the squares (1-4) in a 112x112 image.

Deterministic (seeded): each image is a white 112x112 canvas whose four quadrants each hold a red
square or nothing, at least one; the answer is how many. The text is the same for every row, so the
answer is in the image only (an image-blanked model is at chance, 0.25 over four answers). Written as
JSON Lines plus PNGs into a git-ignored directory (default ``.cache/vlm-tiny``).

    python scripts/make_vlm_tiny_data.py [--out .cache/vlm-tiny] [--n-train 2000] [--n-eval 100] [--blank]

``--blank`` writes the control: every image replaced by a white canvas, same answers.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from PIL import Image

SIZE, QUAD = 112, 56


def image(cells: list[int], blank: bool) -> Image.Image:
    img = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    if not blank:
        for c in cells:
            x, y = (c % 2) * QUAD, (c // 2) * QUAD
            img.paste(Image.new("RGB", (QUAD - 16, QUAD - 16), (220, 30, 30)), (x + 8, y + 8))
    return img


def write(out: Path, split: str, n: int, seed: int, blank: bool) -> None:
    rng = random.Random(seed)
    (out / split).mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        k = rng.randint(1, 4)
        cells = sorted(rng.sample(range(4), k))
        name = f"{split}/{i:05d}.png"
        image(cells, blank).save(out / name)
        rows.append({"prompt": "How many squares?", "answer": k, "image": name})
    (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".cache/vlm-tiny")
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--n-eval", type=int, default=100)
    ap.add_argument("--blank", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    write(out, "train", a.n_train, 0, a.blank)
    write(out, "eval", a.n_eval, 1, a.blank)
    print(out)


if __name__ == "__main__":
    main()
