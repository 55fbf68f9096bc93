"""The main text of an HTML page, for ingest: the page's furniture dropped (navigation bars, "Prev /
Next / Up / Home" bars, tables of contents, site headers, footers and menus, sidebars made of links),
its headings, code blocks, tables and lists kept, as Markdown, so the chunker sees the heading path.

Why not an article extractor alone: on documentation pages (`docs/retrieval.md`, "Clean text")
readability-lxml keeps one "article" block and drops the rest of a man page (its options), trafilatura
drops numbered section headings and keeps texinfo's "Next: / Previous: / Up:" bar, and justext drops
code and option lists, whose few stopwords read as boilerplate to it. Documentation marks its furniture
by structure instead, which is what this module reads:
- elements a page says are furniture (`nav`, `aside`, a top-level `header`/`footer`, ARIA landmark
  roles, `class`/`id` words such as navheader, nav-panel, menu, breadcrumb, sidebar, toc, footer) when
  they hold mostly links, or little text and no heading;
- any block of at least `MIN_LINKS` links whose text is mostly link text (a table of contents, a menu,
  an index);
- lines that are only navigation words ("Prev", "Up", "Home", "Next", "[Index]").
What remains becomes Markdown through `markdownify` (a maintained converter): `#` headings, fenced
code, pipe tables, `-` lists; link targets and images are dropped (their text is kept).

Not here: reading files or their encoding (`loaders.py`), splitting into chunks (`chunker.py`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DROP_TAGS = ("script", "style", "noscript", "template", "nav", "aside", "form", "button", "select", "input",
             "textarea", "svg", "iframe", "object", "embed", "map", "img", "picture", "video", "audio", "canvas")
DROP_ROLES = {"navigation", "banner", "contentinfo", "search", "menu", "menubar", "toolbar", "complementary"}
# class/id words (split on -, _ and case) that name navigation; dropped when mostly links or nearly empty
NAV_WORDS = {"nav", "navbar", "navheader", "navfooter", "navigation", "menu", "mainmenu", "submenu", "menubar",
             "breadcrumb", "breadcrumbs", "crumbs", "sidebar", "sphinxsidebar", "sphinxsidebarwrapper", "related",
             "toc", "toctree", "pager", "pagination", "skip", "searchbox", "searchmenu", "topbar", "nosearch",
             "tagline", "headerlink", "navpanel", "navigate"}
# class/id words that name a page's frame: dropped when mostly links, or short and without a heading
FRAME_WORDS = {"header", "footer", "masthead", "banner", "copyright", "colophon", "legalnotice"}
LINK_SHARE = 0.5  # a block whose text is at least this share link text is navigation
MIN_LINKS = 3  # ... when it holds at least this many links (one linked word in a sentence is prose)
FRAME_WORDS_MAX = 40  # a frame element with fewer words and no heading is furniture
_NAV_LINE = re.compile(r"^[\s\[\]|:·»«<>/()-]*((prev(ious)?|next|up|home|top|index|contents|table of contents|"
                       r"back|go to|search|main page)[\s\[\]|:·»«<>/().,-]*)+$", re.I)
_BLANKS = re.compile(r"\n{3,}")


@dataclass(frozen=True, slots=True)
class Page:
    title: str  # the page's <title> (else its first heading); "" when it has neither
    text: str  # Markdown: "#" headings, fenced code, pipe tables, "-" lists; "" when the page has no main text


def main_text(html: str) -> Page:
    """The page's title and main text (`Page.text` empty when nothing but furniture is left)."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(html, "lxml")
    title = " ".join((soup.title.get_text(" ") if soup.title else "").split())
    body = soup.body or soup
    for tag in body.find_all(DROP_TAGS):
        tag.decompose()
    for tag in body.find_all(_is_furniture):
        if not tag.decomposed:
            tag.decompose()
    main = _main_region(body)
    for tag in reversed(main.find_all(["ul", "ol", "dl", "table", "div", "p", "td", "tr"])):
        if not tag.decomposed and _link_list(tag):
            tag.decompose()
    text = _markdown(main)
    if not title:
        first = re.search(r"^#{1,6} +(.+)$", text, re.M)
        title = first.group(1).strip() if first else ""
    return Page(title, text)


def _words(tag) -> int:
    return len(tag.get_text(" ").split())


def _link_words(tag) -> tuple[int, int]:
    """(links with a target, words inside them)."""
    links = [a for a in tag.find_all("a") if a.get("href")]
    return len(links), sum(len(a.get_text(" ").split()) for a in links)


def _class_words(tag) -> set[str]:
    names = [*(tag.get("class") or []), tag.get("id") or ""]
    out: set[str] = set()
    for name in names:
        name = re.sub(r"([a-z])([A-Z])", r"\1 \2", str(name)).lower()
        parts = [p for p in re.split(r"[\s_-]+", name) if p]
        out.update(parts)
        out.add("".join(parts))  # "nav-panel" is also "navpanel"
    return out


def _is_furniture(tag) -> bool:
    if tag.name in ("html", "body", "main", "article") or tag.decomposed:
        return False
    role = (tag.get("role") or "").lower()
    if role in DROP_ROLES:
        return True
    words = _class_words(tag)
    nav, frame = bool(words & NAV_WORDS), bool(words & FRAME_WORDS)
    if tag.name in ("header", "footer"):
        frame = frame or tag.find_parent(["article", "main", "section"]) is None
    if not (nav or frame):
        return False
    total = _words(tag)
    links, linked = _link_words(tag)
    if total == 0 or (links and linked >= LINK_SHARE * total):
        return True
    if nav:
        return total < 12 and tag.find(["pre", "table"]) is None  # a widget's title ("Quick search") goes too
    return total < FRAME_WORDS_MAX and tag.find(["h1", "h2", "h3", "h4", "h5", "h6"]) is None


def _link_list(tag) -> bool:
    """A table of contents, a menu, an index: many links, little else."""
    links, linked = _link_words(tag)
    return links >= MIN_LINKS and linked >= LINK_SHARE * max(1, _words(tag))


def _main_region(body):
    """`<main>`, `role=main` or the one `<article>` when the page marks one holding most of its text, else the body."""
    total = max(1, _words(body))
    marked = body.find_all("main") or body.find_all(attrs={"role": "main"}) or body.find_all("article")
    if len(marked) == 1 and _words(marked[0]) >= 0.3 * total:
        return marked[0]
    return body


def is_navigation(line: str) -> bool:
    """Whether a line holds navigation words only ("Prev | Up | Next", "[Index]", "Home")."""
    return bool(line.strip()) and _NAV_LINE.match(line) is not None


def _markdown(tag) -> str:
    from markdownify import MarkdownConverter

    converter = MarkdownConverter(heading_style="ATX", bullets="-", strip=["a", "img"], escape_asterisks=False,
                                  escape_underscores=False, escape_misc=False, code_language="")
    text = converter.convert_soup(tag)
    lines = [line.rstrip() for line in text.splitlines()]
    kept, fenced = [], False
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            line = line.replace("¶", "").rstrip()
            if is_navigation(line):
                continue
        kept.append(line)
    return _BLANKS.sub("\n\n", "\n".join(kept)).strip()
