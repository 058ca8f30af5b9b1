"""The project's own tokenizer: a byte-level BPE trained locally with ``tokenizers``.

No model hub is reachable, so token counts for text workloads (GSM8K, MuSiQue, SEC-like
prompts) come from a tokenizer trained here over the shared public text corpora. It is
byte-level (every string encodes, nothing is unknown) and its vocabulary is sized so that
English prose comes out at about 4 characters per token, as the tokenizers of the models
the papers served do (Llama-3's tokenizer gives ~4.2 on English prose). Absolute counts
differ from Llama-3's by some percent; the workloads need realistic lengths, not exact ones.

The trained file lives in ``bench/data/tokenizer/tokenizer.json`` (see the README there
for the corpora and the exact training command). Retrain with::

    python -m bench.workloads.tokenizer --out bench/data/tokenizer --traces PATH/TO/shared/traces

(or with plain-text ``CORPUS_FILE ...`` arguments instead of ``--traces``).

API: :func:`load_tokenizer` (cached ``tokenizers.Tokenizer``), :func:`count_tokens`,
:func:`encode`, :func:`train_tokenizer`. Heavy work is only in training; loading takes a
few milliseconds.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from bench import DATA_DIR

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENIZER_DIR = DATA_DIR / "tokenizer"
TOKENIZER_FILE = TOKENIZER_DIR / "tokenizer.json"
DEFAULT_VOCAB_SIZE = 16384
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")


def _tokenizers() -> ModuleType:
    try:
        import tokenizers
    except ImportError:  # pragma: no cover - the engine extra installs it
        raise ImportError(
            "bench.workloads.tokenizer needs the `tokenizers` package (pip install tokenizers, or the "
            "project's `engine` extra)"
        ) from None
    return tokenizers


@lru_cache(maxsize=4)
def load_tokenizer(path: str | None = None) -> Tokenizer:
    """The shipped tokenizer (or one saved at ``path``), loaded once per process."""
    Tokenizer = _tokenizers().Tokenizer  # noqa: N806
    p = Path(path) if path is not None else TOKENIZER_FILE
    if not p.exists():
        raise FileNotFoundError(
            f"no tokenizer at {p}; train one with `python -m bench.workloads.tokenizer --out DIR CORPUS...`"
        )
    return Tokenizer.from_file(str(p))


def encode(text: str) -> list[int]:
    """Token ids of ``text`` (no special tokens added)."""
    return list(load_tokenizer().encode(text, add_special_tokens=False).ids)


def count_tokens(text: str) -> int:
    """Number of tokens in ``text`` under the shipped tokenizer (no special tokens)."""
    return len(load_tokenizer().encode(text, add_special_tokens=False).ids)


def count_tokens_batch(texts: Sequence[str]) -> list[int]:
    """:func:`count_tokens` for many texts at once (parallel inside ``tokenizers``)."""
    encs = load_tokenizer().encode_batch(list(texts), add_special_tokens=False)
    return [len(e.ids) for e in encs]


def train_tokenizer(
    texts: Iterable[str], out_dir: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> Path:
    """Train a byte-level BPE over ``texts`` and save ``tokenizer.json`` in ``out_dir``."""
    tk = _tokenizers()
    decoders, models, pre_tokenizers, trainers = (
        tk.decoders,
        tk.models,
        tk.pre_tokenizers,
        tk.trainers,
    )
    tok = tk.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokenizer.json"
    path.write_text(tok.to_str(pretty=False), encoding="utf-8")
    return path


def _lines(paths: Sequence[str]) -> Iterable[str]:
    for p in paths:
        with open(p, encoding="utf-8") as f:
            yield from f


def shared_corpus(traces_dir: str | Path, heldout: bool = False) -> Iterator[str]:
    """The training texts, read from a copy of the shared traces folder.

    GSM8K test (question + answer), the distinct MuSiQue passages (title + text), and
    ShareGPT turns until about 12 MB of text; every 10th document is held out
    (``heldout=True`` yields only those, for measuring characters per token).
    """
    root = Path(traces_dir)
    docs: list[str] = []
    with (root / "gsm8k" / "test.jsonl").open(encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            docs.append(d["question"] + " " + d["answer"])
    seen: set[str] = set()
    for q in json.loads((root / "cacheblend_musique" / "musique_s.json").read_text("utf-8")):
        for c in q["ctxs"]:
            t = c["title"] + ". " + c["text"]
            if t not in seen:
                seen.add(t)
                docs.append(t)
    n_chars = 0
    sharegpt = root / "sharegpt" / "ShareGPT_V3_unfiltered_cleaned_split.salvaged.jsonl.gz"
    with gzip.open(sharegpt, "rt", encoding="utf-8") as f:
        for line in f:
            for turn in json.loads(line).get("conversations", []):
                t = turn.get("value", "")
                if t:
                    docs.append(t)
                    n_chars += len(t)
            if n_chars > 13_000_000:
                break
    for i, t in enumerate(docs):
        if (i % 10 == 0) == heldout:
            yield t.replace("\n", " ")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Train the project's byte-level BPE tokenizer.")
    ap.add_argument("corpus", nargs="*", help="plain-text corpus files")
    ap.add_argument("--traces", help="the shared traces folder (GSM8K, MuSiQue, ShareGPT)")
    ap.add_argument("--out", default=str(TOKENIZER_DIR), help="output folder")
    ap.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    args = ap.parse_args(argv)
    if not args.corpus and not args.traces:
        ap.error("give corpus files or --traces DIR")
    texts: Iterable[str] = _lines(args.corpus) if args.corpus else shared_corpus(args.traces)
    path = train_tokenizer(texts, args.out, args.vocab_size)
    print(f"wrote {path}")
    if args.traces:
        held = list(shared_corpus(args.traces, heldout=True))
        tok = load_tokenizer(str(path))
        n_tok = sum(len(e.ids) for e in tok.encode_batch(held, add_special_tokens=False))
        print(f"held-out: {sum(map(len, held)) / n_tok:.2f} characters per token")


if __name__ == "__main__":
    main()
