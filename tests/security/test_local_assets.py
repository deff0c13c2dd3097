"""Nothing the service serves references another host (issue 8, item 15).

Every page served without login (found by walking the URL configuration, following redirects such as
/admin/ -> /admin/login/) is fetched, and so is every stylesheet it links (and what those @import):
each src/href/srcset/action, each CSS url() and @import must be relative or on this host.
"""
from __future__ import annotations

import re
import urllib.parse
from html.parser import HTMLParser
from pathlib import Path

import drf_spectacular
from django.template import Context, Template
from django.urls import URLPattern, URLResolver, get_resolver

HOST = "testserver"
_CSS_REF = re.compile(r"""url\(\s*['"]?([^'")\s]+)|@import\s+['"]([^'"]+)""", re.I)
_URL_ATTRS = {"src", "href", "action", "poster", "data", "formaction"}


class _Refs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []
        self.stylesheets: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name, value in attrs.items():
            if value and name in _URL_ATTRS:
                self.refs.append(value)
            if value and name in ("srcset", "imagesrcset"):
                self.refs += [part.split()[0] for part in value.split(",") if part.strip()]
            if value and name == "style":
                self.refs += css_refs(value)
        if tag == "link" and attrs.get("href") and ("stylesheet" in (attrs.get("rel") or "")
                                                    or attrs["href"].split("?")[0].endswith(".css")):
            self.stylesheets.append(attrs["href"])
        self._in_style = tag == "style"

    def handle_endtag(self, tag):
        self._in_style = False

    def handle_data(self, data):
        if self._in_style:
            self.refs += css_refs(data)


def css_refs(css: str) -> list[str]:
    return [a or b for a, b in _CSS_REF.findall(css)]


def is_local(ref: str) -> bool:
    parts = urllib.parse.urlsplit(ref.strip())
    if parts.scheme == "data":
        return True
    return parts.scheme in ("", "http", "https") and parts.netloc in ("", HOST)


def public_paths() -> list[str]:
    """Every route without parameters, from the URL configuration itself."""
    found: list[str] = []

    def walk(patterns, prefix: str) -> None:
        for pattern in patterns:
            text = str(pattern.pattern).lstrip("^").rstrip("$").replace("\\Z", "")
            if "<" in text or "(" in text or "[" in text:
                continue
            if isinstance(pattern, URLResolver):
                walk(pattern.url_patterns, prefix + text)
            elif isinstance(pattern, URLPattern):
                found.append("/" + prefix + text)

    walk(get_resolver().url_patterns, "")
    return sorted(set(found))


def _body(resp) -> str:
    raw = b"".join(resp.streaming_content) if resp.streaming else resp.content
    return raw.decode("utf-8", "replace")


def _absolute(base: str, ref: str) -> str:
    return urllib.parse.urljoin(f"http://{HOST}{base}", ref)


def _fetch_local(client, url: str):
    return client.get(urllib.parse.urlsplit(url).path, follow=True)


def test_refs_are_found_and_judged():
    """The checker itself: it sees the external fonts of drf-spectacular's own Redoc page."""
    original = Path(drf_spectacular.__file__).parent / "templates/drf_spectacular/redoc.html"
    html = Template(original.read_text()).render(Context({"settings": "{}", "schema_url": "/api/schema/",
                                                          "redoc_standalone": "/static/redoc.js"}))
    parser = _Refs()
    parser.feed(html)
    assert [r for r in parser.refs if not is_local(r)] == [
        "https://fonts.googleapis.com", "https://fonts.gstatic.com",
        "https://fonts.googleapis.com/css2?family=Montserrat:wght@300;400;700&family=Roboto:wght@300;400;700&display=swap"]
    assert css_refs("a{background:url('//cdn.example/x.png')} @import 'https://e.example/a.css';") == [
        "//cdn.example/x.png", "https://e.example/a.css"]
    assert not is_local("//cdn.example/x.png") and is_local("../img/x.svg") and is_local("data:image/png;base64,")


def test_no_page_served_without_login_references_another_host(anon, db):
    pages: dict[str, str] = {}
    for path in public_paths():
        resp = anon.get(path, follow=True)
        if resp.status_code == 200 and resp.get("Content-Type", "").startswith("text/html"):
            final = resp.redirect_chain[-1][0] if resp.redirect_chain else path
            pages[urllib.parse.urlsplit(final).path] = _body(resp)
    assert {"/api/docs/", "/api/redoc/", "/admin/login/"} <= set(pages), sorted(pages)

    external: list[str] = []
    seen_css: set[str] = set()
    for page, html in pages.items():
        parser = _Refs()
        parser.feed(html)
        external += [f"{page}: {ref}" for ref in parser.refs if not is_local(ref)]
        queue = [_absolute(page, href) for href in parser.stylesheets if is_local(href)]
        while queue:
            css_url = queue.pop()
            if css_url in seen_css:
                continue
            seen_css.add(css_url)
            resp = _fetch_local(anon, css_url)
            assert resp.status_code == 200, css_url
            for ref in css_refs(_body(resp)):
                if not is_local(ref):
                    external.append(f"{css_url}: {ref}")
                elif ref.split("?")[0].endswith(".css"):
                    queue.append(urllib.parse.urljoin(css_url, ref))
    assert seen_css, "the pages link stylesheets (admin, Swagger UI): they must have been checked"
    assert not external, "\n".join(external)
    # Swagger UI would add a badge image from validator.swagger.io (with our schema's URL) on any host
    # but localhost: it is switched off in its settings.
    assert '"validatorUrl": null' in pages["/api/docs/"]
