"""`python -m pretrain.data.fetch --output DIR`: real English text, offline, written in C4's exact layout.

No C4 copy is reachable here; the gensim 4.4.0 wheel on PyPI carries a Wikipedia sample (MediaWiki XML)
and 300 news articles (`lee_background.cor`). The wheel is downloaded once per machine into the cache
(default ~/.cache/synthesizer-pretrain/); markup and redirects are stripped, each article section becomes
one document (C4 documents are web pages of a few KB), and the documents go to
`c4-train.0000K-of-0000N.json.gz` files plus `c4-validation.00000-of-00001.json.gz`. Nothing of this text
belongs in the repository. Everything downstream reads this layout, so the real C4 works unchanged.
"""
from __future__ import annotations

import argparse
import bz2
import logging
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path
from typing import Iterator

from pretrain.core.config import UsageError
from pretrain.data.documents import train_name, validation_name, write_documents

log = logging.getLogger(__name__)

GENSIM = "gensim==4.4.0"
WIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
LEE_MEMBER = "gensim/test/test_data/lee_background.cor"
LEE_TIMESTAMP = "2019-04-25T00:00:00Z"  # the file carries none; a fixed C4-style stamp keeps output reproducible
MIN_CHARS = 200  # shorter sections (lists of links, stubs) are dropped, as C4's filters drop short pages


def default_cache() -> Path:
    return Path(os.environ.get("SYNTHESIZER_CACHE", Path.home() / ".cache" / "synthesizer-pretrain"))


def download_wheel(cache: Path) -> Path:
    """The gensim wheel in `cache/downloads`, fetched with pip on first use."""
    dest = cache / "downloads"
    found = sorted(dest.glob("gensim-4.4.0-*.whl"))
    if not found:
        dest.mkdir(parents=True, exist_ok=True)
        log.info("downloading %s into %s", GENSIM, dest)
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", GENSIM]
        pip_download_into(cmd, dest, "gensim-4.4.0-*.whl", GENSIM)
        found = sorted(dest.glob("gensim-4.4.0-*.whl"))
    return found[0]


def pip_download_into(cmd: list[str], dest: Path, pattern: str, what: str) -> None:
    """Run `pip download` (`cmd`) into a private folder under `dest`, then move the file matching `pattern` into
    `dest` in one rename: two jobs (or test workers) fetching at once never read each other's half-written file."""
    with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as tmp:
        done = subprocess.run([*cmd, "-d", tmp], capture_output=True, text=True)
        got = sorted(Path(tmp).glob(pattern))
        if done.returncode != 0 or not got:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"could not download {what} from PyPI into {dest}: {last}")
        os.replace(got[0], dest / got[0].name)


# ---------------------------------------------------------------------------------------------------------
# MediaWiki markup -> plain text
# ---------------------------------------------------------------------------------------------------------
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_REF = re.compile(r"<ref[^>/]*/>|<(ref|math|gallery|timeline)[^>]*>.*?</\1>", re.S | re.I)
_TAG = re.compile(r"<[^>]+>")
_TEMPLATE_BRACES = re.compile(r"\{\{|\}\}")
_INNERMOST_TABLE = re.compile(r"\{\|(?:(?!\{\|).)*?\|\}", re.S)
_FILE_LINK = re.compile(r"\[\[(?:File|Image|Category|[a-z\-]{2,12}):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", re.I)
_LINK = re.compile(r"\[\[(?:[^|\[\]]*\|)?((?:[^\[\]]|\[[^\[\]]*\])*)\]\]")  # text may hold [1.1.0]
_EXT_LINK = re.compile(r"\[https?://[^\s\]]+\s?([^\]]*)\]")
_HEADING = re.compile(r"^(={2,})\s*(.*?)\s*\1\s*$", re.M)
_ENTITY = {"&nbsp;": " ", "&ndash;": "–", "&mdash;": "—", "&amp;": "&", "&quot;": '"', "&lt;": "<", "&gt;": ">"}


def _remove_nested(pattern: re.Pattern, text: str) -> str:
    """Strip nested constructs ({{...}}, {|...|}) from the innermost outwards."""
    while True:
        text, n = pattern.subn("", text)
        if not n:
            return text


def _strip_templates(text: str) -> str:
    """Drop {{...}} templates by brace depth (their arguments may hold single braces and pipes)."""
    out, depth, last = [], 0, 0
    for m in _TEMPLATE_BRACES.finditer(text):
        if m.group() == "{{":
            if depth == 0:
                out.append(text[last : m.start()])
            depth += 1
        elif depth:
            depth -= 1
            last = m.end()
    if depth == 0:
        out.append(text[last:])
    return "".join(out)


def strip_markup(wikitext: str) -> str:
    text = _COMMENT.sub("", wikitext)
    text = _REF.sub("", text)
    text = _strip_templates(text)
    text = _remove_nested(_INNERMOST_TABLE, text)
    text = _FILE_LINK.sub("", text)
    text = _LINK.sub(r"\1", text)
    text = _EXT_LINK.sub(r"\1", text)
    text = _TAG.sub("", text).replace("[[", "").replace("]]", "")  # unbalanced leftovers
    text = text.replace("'''", "").replace("''", "")
    for entity, char in _ENTITY.items():
        text = text.replace(entity, char)
    lines = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(("*", "#", ":", ";", "|", "!", "{", "}")):
            line = line.lstrip("*#:;|!{} ").strip()
        lines.append(re.sub(r"[ \t]+", " ", line))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def wikipedia_documents(xml_bytes: bytes) -> Iterator[dict]:
    """One document per article section (redirects and non-article pages dropped)."""
    ns = "{http://www.mediawiki.org/xml/export-0.10/}"
    root = ET.fromstring(xml_bytes)
    for page in root.iter(ns + "page"):
        title = page.findtext(ns + "title") or ""
        text = page.findtext(f"{ns}revision/{ns}text") or ""
        if page.findtext(ns + "ns") != "0" or page.find(ns + "redirect") is not None or text.lstrip().upper().startswith("#REDIRECT"):
            continue
        timestamp = page.findtext(f"{ns}revision/{ns}timestamp") or LEE_TIMESTAMP
        url = "https://en.wikipedia.org/wiki/" + title.replace(" ", "_")
        parts = _HEADING.split(text)  # [lead, marks, heading, body, marks, heading, body, ...]
        sections = [("", parts[0])] + [(parts[i + 1], parts[i + 2]) for i in range(1, len(parts) - 2, 3)]
        for heading, body in sections:
            plain = strip_markup(body)
            if len(plain) >= MIN_CHARS:
                anchor = "#" + heading.replace(" ", "_") if heading else ""
                yield {"text": plain, "timestamp": timestamp, "url": url + anchor}


def lee_documents(raw: bytes) -> Iterator[dict]:
    for i, line in enumerate(raw.decode("utf-8", errors="replace").splitlines()):
        if len(line.strip()) >= MIN_CHARS:
            yield {"text": line.strip(), "timestamp": LEE_TIMESTAMP, "url": f"gensim:lee_background.cor#{i}"}


def fetch(output: Path, cache: Path, num_train_files: int = 8, valid_every: int = 20) -> list[Path]:
    """Write the C4-layout files into `output` (skipped when already complete); returns their paths."""
    names = [train_name(i, num_train_files) for i in range(num_train_files)] + [validation_name(0, 1)]
    paths = [output / n for n in names]
    if all(p.is_file() for p in paths):
        return paths
    # files of an earlier run with another --train-files would be mixed in by the 'c4-train.*' glob downstream
    stale = sorted(p.name for p in output.glob("c4-train.*.json.gz") if p.name not in names)
    if stale:
        raise UsageError(f"{output} already holds {len(stale)} other c4-train files ({stale[0]}, ...); "
                         "remove them or choose another --output")
    with zipfile.ZipFile(download_wheel(cache)) as wheel:
        docs = list(wikipedia_documents(bz2.decompress(wheel.read(WIKI_MEMBER))))
        docs += list(lee_documents(wheel.read(LEE_MEMBER)))
    # every `valid_every`-th document is held out; the rest are dealt round-robin over the train files
    valid = docs[::valid_every]
    train = [d for i, d in enumerate(docs) if i % valid_every]
    output.mkdir(parents=True, exist_ok=True)
    for i in range(num_train_files):
        write_documents(paths[i], train[i::num_train_files])
    write_documents(paths[-1], valid)
    log.info("wrote %d train and %d validation documents (%.1f MB of text) to %s", len(train), len(valid),
             sum(len(d["text"]) for d in docs) / 1e6, output)
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pretrain.data.fetch", description=__doc__.splitlines()[0])
    p.add_argument("--output", type=Path, default=None, help="folder for the json.gz files (default CACHE/c4)")
    p.add_argument("--cache", type=Path, default=default_cache(), help="download cache (default %(default)s)")
    p.add_argument("--train-files", type=int, default=8, help="number of c4-train files to write")
    args = p.parse_args(argv)
    if args.train_files < 1:
        p.error(f"--train-files must be at least 1, got {args.train_files}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    output = args.output or args.cache / "c4"
    try:
        paths = fetch(output, args.cache, args.train_files)
    except (ValueError, RuntimeError) as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
