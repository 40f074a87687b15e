"""A tokenizer and a text dataset made on this machine, for CPU runs and tests (no downloads).

    python -m rsdp.torchtitan.assets ./outputs/assets

writes ``tokenizer/`` (a byte-level BPE in Hugging Face's ``tokenizer.json`` format, with the
``tokenizer_config.json`` torchtitan reads its BOS/EOS tokens from) and ``dataset/train.jsonl`` (one
``{"text": ...}`` document per line). The text comes from a seeded first-order Markov chain over a
made-up vocabulary, so a model has something to learn and every machine writes the same bytes.
"""

import argparse
import json
import random
from pathlib import Path

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def _documents(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "ve", "zu", "an", "el", "or", "is"]
    words = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(400)})
    successors = {word: rng.sample(words, 6) for word in words}
    documents = []
    for _ in range(count):
        word, sentences = rng.choice(words), []
        for _ in range(rng.randint(2, 8)):
            sentence = [word]
            for _ in range(rng.randint(4, 14)):
                word = rng.choice(successors[word])
                sentence.append(word)
            sentences.append(" ".join(sentence).capitalize() + ".")
        documents.append(" ".join(sentences))
    return documents


def write_assets(folder: str | Path, *, documents: int = 2000, vocab_size: int = 2048, seed: int = 0) -> Path:
    """Write ``folder/tokenizer`` and ``folder/dataset/train.jsonl``; returns ``folder``. Idempotent."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = Path(folder)
    tokenizer_dir, dataset_dir = folder / "tokenizer", folder / "dataset"
    if (tokenizer_dir / "tokenizer.json").exists() and (dataset_dir / "train.jsonl").exists():
        return folder
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    dataset_dir.mkdir(parents=True, exist_ok=True)
    texts = _documents(documents, seed)
    with open(dataset_dir / "train.jsonl", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    with open(tokenizer_dir / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": False, "add_eos_token": False}, f)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    write_assets(parser.parse_args().folder)


if __name__ == "__main__":
    main()
