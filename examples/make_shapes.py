"""Write a small image folder to train on: PNGs of circles, squares and triangles, a sub-folder per class.

    python examples/make_shapes.py shapes            # 300 images (100 a class), 40 x 40 to 56 x 56 pixels
    paratrain train --model examples/residual_cnn.py:build --dataset imagefolder --data-dir shapes

Each image has its own size, colours, position and a little noise, so the folder looks like real data to
the loader (it resizes them all to the median size) and the classes take a few steps to learn.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from PIL import Image, ImageDraw

CLASSES = ("circle", "square", "triangle")


def draw(shape: str, rng: random.Random) -> Image.Image:
    side = rng.randint(40, 56)
    background = tuple(rng.randint(0, 90) for _ in range(3))
    colour = tuple(rng.randint(150, 255) for _ in range(3))
    image = Image.new("RGB", (side, side + rng.randint(-4, 4)), background)
    pen = ImageDraw.Draw(image)
    r = rng.randint(side // 5, side // 3)
    cx, cy = rng.randint(r, side - r), rng.randint(r, image.height - r)
    if shape == "circle":
        pen.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif shape == "square":
        pen.rectangle((cx - r, cy - r, cx + r, cy + r), fill=colour)
    else:
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    for _ in range(side):  # specks of noise
        pen.point((rng.randrange(side), rng.randrange(image.height)), fill=tuple(rng.randint(0, 255) for _ in "rgb"))
    return image


def write(out: Path, per_class: int = 100, seed: int = 0) -> list[Path]:
    """Write `per_class` PNGs of each shape under out/<shape>/; returns their paths."""
    rng = random.Random(seed)
    paths = []
    for shape in CLASSES:
        folder = out / shape
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            path = folder / f"{shape}-{i:04d}.png"
            draw(shape, rng).save(path)
            paths.append(path)
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder to write (class sub-folders go in it)")
    parser.add_argument("--per-class", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"wrote {len(write(args.out, args.per_class, args.seed))} images under {args.out}")
