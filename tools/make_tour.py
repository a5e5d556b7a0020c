#!/usr/bin/env python
"""Make the small inputs the README's tour uses, in one command:

    python tools/make_tour.py [DIR]      # default: the current folder

Writes
  DIR/photos/<class>/<i>.<ext>  3 class folders (bird, cat, dog) of 8 images each, mixing .jpg,
                                .jpeg and .png in RGB, grey, RGBA and palette modes, of varied
                                sizes;
  DIR/corpus/docs.jsonl         300 JSON documents with a "text" key;
  DIR/tokenizer.json            a word-level Hugging Face ``tokenizers`` file for that corpus
                                (needs ``pip install 'shardloader[text]'``).
Everything derives from fixed seeds: the same bytes every time.  ``tests/test_readme.py`` runs
every README block on exactly these files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

_KINDS = [
    ("jpg", "RGB"),
    ("jpeg", "L"),
    ("png", "RGBA"),
    ("png", "P"),
    ("jpg", "L"),
    ("png", "RGB"),
    ("jpeg", "RGB"),
    ("png", "L"),
]


def make_photos(root: str, per_class: int = 8) -> None:
    """``root/<class>/<i>.<ext>``: mixed extensions and modes, as real folders are."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c, name in enumerate(("bird", "cat", "dog")):
        os.makedirs(os.path.join(root, name))
        for i in range(per_class):
            ext, mode = _KINDS[(i + c) % len(_KINDS)]
            h, w = int(rng.integers(40, 90)), int(rng.integers(40, 90))
            pixels = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
            Image.fromarray(pixels).convert(mode).save(os.path.join(root, name, f"{i:03d}.{ext}"))


def make_text(root: str, tokenizer: str, docs: int = 300) -> None:
    """``root/docs.jsonl`` and a word-level tokenizer for its words at ``tokenizer``."""
    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = np.random.default_rng(1)
    words = [f"w{i}" for i in range(200)]
    os.makedirs(root)
    with open(os.path.join(root, "docs.jsonl"), "w", encoding="utf-8") as f:
        for _ in range(docs):
            n = int(rng.integers(5, 120))
            f.write(json.dumps({"text": " ".join(rng.choice(words, n))}) + "\n")
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [" ".join(words)], trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]"])
    )
    tok.save(tokenizer)


def make_tour(out: str) -> None:
    """``photos/``, ``corpus/`` and ``tokenizer.json`` in ``out``."""
    made = [os.path.join(out, n) for n in ("photos", "corpus", "tokenizer.json")]
    there = [p for p in made if os.path.exists(p)]
    if there:
        raise FileExistsError(f"{there[0]} exists; pick another folder or remove it")
    make_photos(made[0])
    make_text(made[1], made[2])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", nargs="?", default=".")
    args = p.parse_args(argv)
    try:
        make_tour(args.out)
    except (FileExistsError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"made photos/, corpus/ and tokenizer.json in {os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
