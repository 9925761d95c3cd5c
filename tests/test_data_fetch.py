"""The offline text fetcher: C4's exact file names and fields, markup and redirects gone."""
import gzip
import json
import re
from xml.sax.saxutils import escape

from pretrain.data.fetch import strip_markup, wikipedia_documents


def test_c4_layout_and_clean_text(c4_dir):
    names = sorted(p.name for p in c4_dir.iterdir())
    assert names == [f"c4-train.{i:05d}-of-00008.json.gz" for i in range(8)] + ["c4-validation.00000-of-00001.json.gz"]
    docs = []
    for name in names:
        with gzip.open(c4_dir / name, "rt", encoding="utf-8") as f:
            docs += [json.loads(line) for line in f]
    assert all(set(d) == {"text", "timestamp", "url"} for d in docs)
    assert len(docs) > 1500 and sum(len(d["text"]) for d in docs) > 2_500_000
    assert len({d["url"] for d in docs}) == len(docs)
    text = "\n".join(d["text"] for d in docs)
    for markup in ("[[", "]]", "{{", "}}", "<ref", "'''", "#REDIRECT"):
        assert markup not in text, markup
    assert re.search(r"\bthe\b", text).group() == "the"


def test_markup_stripping_and_redirects():
    wiki = "'''Foo''' is a [[bar|baz]] {{cite|x={{y}}}} thing<ref>r</ref>.\n== History ==\n" + "word " * 60
    assert strip_markup(wiki).startswith("Foo is a baz thing.")
    xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/"><page><title>A B</title><ns>0</ns>'
           '<revision><timestamp>2016-01-01T00:00:00Z</timestamp><text>' + escape(wiki) + '</text></revision></page>'
           '<page><title>R</title><ns>0</ns><redirect title="A"/><revision><text>#REDIRECT [[A]]</text></revision>'
           '</page></mediawiki>')
    docs = list(wikipedia_documents(xml.encode()))
    assert [d["url"] for d in docs] == ["https://en.wikipedia.org/wiki/A_B#History"]  # the lead is too short
    assert docs[0]["timestamp"] == "2016-01-01T00:00:00Z"
