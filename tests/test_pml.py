"""The PML parser: the paper's examples, exact text, escaping, and every error with its position."""

from __future__ import annotations

import pytest

try:  # hypothesis is not in the `test` extra yet: without it the property tests skip
    from hypothesis import given, strategies as st
except ImportError:
    given = st = None  # type: ignore[assignment]

from rag_promptcache.pml import (
    Import, Module, Param, PMLError, Role, Schema, Text, Union,
    escape, parse_prompt, parse_schema, to_pml, unescape,
)

# The paper's running example (§3.2), with nesting and a role holding a module.
TRIP = """<schema name="trip">
<system>You are a travel planner.</system>
<module name="trip-plan">Plan a trip of <param name="duration" len="3"/> to <param name="city" len="2"/>.</module>
<union>
  <module name="tokyo">Tokyo.<module name="tokyo-food">Sushi &amp; ramen.</module></module>
  <module name="paris">Paris.</module>
</union>
<user>Read this: <module name="doc-1">First doc.</module></user>
<module name="doc-2">Second.</module><module name="doc-3">3</module><module name="doc-4">4</module>
<module name="doc-5">5</module>
</schema>"""
SCHEMAS = {"trip": parse_schema(TRIP)}


def schema_error(src: str) -> PMLError:
    with pytest.raises(PMLError) as info:
        parse_schema(src)
    return info.value


def prompt_error(src: str) -> PMLError:
    with pytest.raises(PMLError) as info:
        parse_prompt(src, SCHEMAS)
    return info.value


# --- the happy path ---------------------------------------------------------------------------

def test_paper_schema_tree_and_lookups() -> None:
    schema = SCHEMAS["trip"]
    assert schema.name == "trip"
    kinds = [type(node).__name__ for node in schema.children if not isinstance(node, Text)]
    assert kinds == ["Role", "Module", "Union", "Role", "Module", "Module", "Module", "Module"]
    plan = schema.modules["trip-plan"]
    assert plan.params == (Param("duration", 3), Param("city", 2))
    assert plan.children[0] == Text("Plan a trip of ")
    assert schema.modules["tokyo-food"].children == (Text("Sushi & ramen."),)
    assert schema.parents == {
        "trip-plan": None, "tokyo": None, "tokyo-food": "tokyo", "paris": None,
        "doc-1": None, "doc-2": None, "doc-3": None, "doc-4": None, "doc-5": None,
    }
    assert schema.union_of == {"tokyo": 0, "paris": 0}
    user = schema.children[7]
    assert user == Role("user", (Text("Read this: "), Module("doc-1", (Text("First doc."),))))
    # positions: the union's `<`, and a text node's first character
    union = schema.children[5]
    assert isinstance(union, Union) and (union.line, union.column) == (4, 1)
    assert (plan.children[2].line, plan.children[2].column) == (3, 73)


def test_union_index_counts_in_document_order_including_nested() -> None:
    schema = parse_schema(
        '<schema name="s"><union><module name="a"><union><module name="b"/><module name="c"/>'
        '</union></module><module name="d"/></union><union><module name="e"/></union></schema>')
    assert schema.union_of == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 2}
    assert schema.parents == {"a": None, "b": "a", "c": "a", "d": None, "e": None}


def test_paper_prompt_with_params_nested_import_and_roles() -> None:
    prompt = parse_prompt(
        '<prompt schema="trip">\n  <trip-plan duration="3 days" city="Tokyo &amp; Kyoto"/>\n'
        '  <tokyo>\n    <tokyo-food/>\n  </tokyo>\n  <user>What should I eat?</user>\n</prompt>',
        SCHEMAS)
    imports = [node for node in prompt.children if not isinstance(node, Text)]
    assert imports == [
        Import("trip-plan", (("duration", "3 days"), ("city", "Tokyo & Kyoto"))),
        Import("tokyo", (), (Import("tokyo-food", ()),)),
        Role("user", (Text("What should I eat?"),)),
    ]
    assert prompt.schema == "trip" and prompt.children[0] == Text("\n  ")
    assert (imports[1].line, imports[1].column) == (3, 3)
    assert (imports[1].children[0].line, imports[1].children[0].column) == (4, 5)


def test_text_is_kept_exactly() -> None:
    body = " \n\t  leading and trailing\r\n whitespace, ünïcødé 東京 🚀 > ok \n\n"
    schema = parse_schema(f'<schema name="s"><module name="m">{body}</module></schema>')
    assert schema.modules["m"].children == (Text(body),)
    top = parse_schema(f'<schema name="s">{body}<user>{body}</user></schema>')
    assert top.children == (Text(body), Role("user", (Text(body),)))


def test_entities_decode_in_text_and_attributes() -> None:
    schema = parse_schema('<schema name="a &lt;b&gt; &#x1F600;">&lt;&gt;&amp;&quot;&apos;&#65;&#x263a;'
                          "</schema>")
    assert schema.name == "a <b> 😀"
    assert schema.children == (Text("<>&\"'A☺"),)


def test_comments_are_dropped_and_text_around_them_joins() -> None:
    schema = parse_schema('<!-- head -->\n<schema name="s">ab<!-- <module> & -->cd'
                          '<module name="m"><!-- x --></module></schema><!-- tail -->\n')
    assert schema.children == (Text("abcd"), Module("m", ()))
    assert (schema.children[0].line, schema.children[0].column) == (2, 18)


def test_lenient_but_legal_forms() -> None:
    schema = parse_schema("\n  <schema  name = 's' >"
                          "<module name='m'><param name='p' len='07'></param></module>"
                          '<module name="résumé_1.x"/></schema>\n')
    assert schema.modules["m"].params == (Param("p", 7),)
    assert schema.modules["résumé_1.x"] == Module("résumé_1.x", ())
    prompt = parse_prompt("<prompt schema='s'><m p = 'v'/><résumé_1.x></résumé_1.x></prompt>",
                          {"s": schema})
    assert prompt.children == (Import("m", (("p", "v"),)), Import("résumé_1.x", ()))


def test_roles_inside_a_module_and_their_params() -> None:
    schema = parse_schema('<schema name="s"><module name="m"><system>Be <param name="tone" len="2"/>'
                          '</system><module name="n"><param name="x" len="1"/></module></module></schema>')
    assert schema.modules["m"].params == (Param("tone", 2),)
    assert schema.modules["n"].params == (Param("x", 1),)


def test_to_pml_round_trips_the_tree() -> None:
    schema = SCHEMAS["trip"]
    assert parse_schema(to_pml(schema)) == schema
    assert parse_schema(to_pml(schema)).union_of == schema.union_of
    prompt = parse_prompt('<prompt schema="trip"><trip-plan city="&quot;x&apos;"/>'
                          "<tokyo><tokyo-food/></tokyo><user>&lt;hi&gt;</user></prompt>", SCHEMAS)
    assert to_pml(prompt) == ('<prompt schema="trip"><trip-plan city="&quot;x&apos;"/>'
                              "<tokyo><tokyo-food/></tokyo><user>&lt;hi&gt;</user></prompt>")
    assert parse_prompt(to_pml(prompt), SCHEMAS) == prompt


def test_to_pml_keeps_canonical_source_byte_for_byte() -> None:
    src = ('<schema name="s">\n  <system>Hi\r\n</system>\n<module name="m">a &amp; b &lt; c'
           '<param name="p" len="4"/>\t</module>\n</schema>')
    assert to_pml(parse_schema(src)) == src


def test_escape_and_unescape() -> None:
    assert escape("a<b>&\"'") == "a&lt;b&gt;&amp;\"'"
    assert escape("a<b>&\"'", quote=True) == "a&lt;b&gt;&amp;&quot;&apos;"
    assert unescape("&lt;&#60;&#x3C;&#x3c;&amp;lt;") == "<<<<&lt;"
    assert unescape("no entities > here") == "no entities > here"


if given is None:
    def test_property_tests_need_hypothesis() -> None:
        pytest.skip("pip install hypothesis to run the property tests")
else:
    @given(st.text())
    def test_escape_round_trips(s: str) -> None:
        assert unescape(escape(s)) == s
        assert unescape(escape(s, quote=True)) == s
        assert "<" not in escape(s) and '"' not in escape(s, quote=True)

    @given(st.text(min_size=1), st.text())
    def test_any_text_and_value_survive_parsing(text: str, value: str) -> None:
        schema = parse_schema(f'<schema name="s"><module name="m">{escape(text)}'
                              f'<param name="p" len="1"/></module></schema>')
        assert schema.modules["m"].children[0] == Text(text)
        prompt = parse_prompt(f"<prompt schema='s'><m p='{escape(value, quote=True)}'/></prompt>",
                              {"s": schema})
        assert prompt.children == (Import("m", (("p", value),)),)

    _texts = st.text(min_size=1).map(Text)

    @st.composite
    def _schemas(draw: st.DrawFn) -> Schema:
        counter = iter(range(10_000))

        def module(depth: int) -> Module:
            kids: list = [draw(_texts)] if draw(st.booleans()) else []
            if depth < 2 and draw(st.booleans()):
                kids.append(module(depth + 1))
            if draw(st.booleans()):
                kids.append(Param(f"p{next(counter)}", draw(st.integers(1, 99))))
            return Module(f"m{next(counter)}", tuple(kids))

        children: list = []
        for _ in range(draw(st.integers(0, 4))):
            kind = draw(st.sampled_from(["module", "union", "role"]))
            if draw(st.booleans()):  # never two texts in a row: the parser would join them
                children.append(draw(_texts))
            if kind == "module":
                children.append(module(0))
            elif kind == "union":
                children.append(Union(tuple(module(1) for _ in range(draw(st.integers(1, 3))))))
            else:
                children.append(Role(draw(st.sampled_from(["system", "user", "assistant"])),
                                     (draw(_texts), module(1))))
        return Schema(draw(st.text(min_size=1).filter(str.strip)), tuple(children))

    @given(_schemas())
    def test_to_pml_round_trips_any_tree(schema: Schema) -> None:
        assert parse_schema(to_pml(schema)) == schema


# --- errors: every one with its line, column, and what it says --------------------------------

S = '<schema name="s">'  # 17 characters, so a tag right after it is at column 18

SCHEMA_ERRORS = [
    # well-formedness
    (f'{S}\n  <module name="a">x', 2, 21, 'unclosed <module> opened at line 2, column 3'),
    (f'{S}<module name="a"></schema>', 1, 35, "mismatched closing tag </schema>: <module>"),
    (f"{S}</module></schema>", 1, 18, "unexpected closing tag </module>"),
    (f"{S}</schema></schema>", 1, 27, "unexpected closing tag </schema>"),
    (f"{S}a < b</schema>", 1, 20, "invalid tag name: found ' ' (write &lt;"),
    (f"{S}<1a/></schema>", 1, 18, "invalid tag name: found '1'"),
    (f"{S}</ module></schema>", 1, 18, "invalid tag name"),
    (f'{S}<module 9="x"/></schema>', 1, 26, "invalid attribute name: found '9'"),
    (f'{S}<module name="a"id="b"/></schema>', 1, 34, "expected whitespace, '>' or '/>'"),
    (f'{S}<module name="a"/ ></schema>', 1, 34, "expected whitespace, '>' or '/>'"),
    ('<schema name="s"', 1, 1, "unterminated tag <schema"),
    (f"{S}</module", 1, 26, "expected '>' to end </module"),
    ('<schema name="s" name="t"></schema>', 1, 18, "duplicate attribute 'name' on <schema>"),
    ('<schema name="s>\n</schema>', 1, 14, "unterminated value of attribute 'name'"),
    (f'{S}<module name="a>x</module><module name="b"/></schema>', 1, 35,
     "'<' in the value of attribute 'name'"),
    ("<schema name=s></schema>", 1, 14, "must be quoted"),
    ('<schema name></schema>', 1, 13, "expected '=' after attribute 'name'"),
    (f'{S}</schema>\n  x', 2, 3, "text after the root </schema>"),
    (f'x{S}</schema>', 1, 1, "text before the root <schema>"),
    (f'{S}</schema><schema name="t"></schema>', 1, 27, "<schema> after the root </schema>"),
    ('<prompt schema="s"></prompt>', 1, 1, "expected the root <schema>, found <prompt>"),
    ("  \n", 2, 1, "no <schema> root element"),
    ("<!DOCTYPE schema>", 1, 1, "DOCTYPE, CDATA and processing instructions"),
    ('<?xml version="1.0"?><schema name="s"/>', 1, 1, "processing instructions"),
    (f"{S}<![CDATA[x]]></schema>", 1, 18, "CDATA"),
    (f"{S}<!-- x </schema>", 1, 18, "unterminated comment"),
    # entities
    (f"{S}\nAT&T</schema>", 2, 3, "bare '&': write &amp;"),
    (f"{S}a & b</schema>", 1, 20, "bare '&'"),
    (f"{S}&nbsp;</schema>", 1, 18, "bad entity '&nbsp;'; valid: &lt;"),
    (f"{S}&lt</schema>", 1, 18, "bare '&': write &amp; for a literal '&' (an entity ends with ';')"),
    (f"{S}&#X41;</schema>", 1, 18, "bad entity '&#X41;'"),
    (f"{S}&#xD800;</schema>", 1, 18, "entity '&#xD800;' is not a valid character"),
    (f"{S}&#1114112;</schema>", 1, 18, "not a valid character"),
    ('<schema name="a&b"></schema>', 1, 16, "bare '&'"),
    # schema rules
    (f'{S}\n<module name="a"/>\n<module name="a"/>\n</schema>', 3, 1,
     "duplicate module name 'a' (first at line 2, column 1)"),
    (f'{S}<module name="a"><module name="a"/></module></schema>', 1, 35, "duplicate module name 'a'"),
    (f'{S}<union><module name="a"/></union><module name="a"/></schema>', 1, 51, "duplicate module"),
    ("<schema></schema>", 1, 1, "<schema> needs a 'name' attribute"),
    (f"{S}<module>x</module></schema>", 1, 18, "<module> needs a 'name' attribute"),
    (f'{S}<module name=" ">x</module></schema>', 1, 26, "empty 'name' attribute on <module>"),
    (f'{S}<module name="a b"/></schema>', 1, 26, "invalid module name 'a b'"),
    (f'{S}<module name="user"/></schema>', 1, 26, "must not be a role"),
    (f'{S}<module name="a" id="x"/></schema>', 1, 35, "unknown attribute 'id' on <module>; valid: name"),
    ('<schema name="s" version="2"></schema>', 1, 18, "unknown attribute 'version' on <schema>"),
    (f'{S}<union n="1"><module name="a"/></union></schema>', 1, 25,
     "unknown attribute 'n' on <union>; valid: none"),
    (f'{S}<user role="x"/></schema>', 1, 24, "unknown attribute 'role' on <user>"),
    (f'{S}<union><module name="a" x="1"/></union></schema>', 1, 42, "unknown attribute 'x'"),
    (f'{S}<module name="a"><param name="p" len="3" max="4"/></module></schema>', 1, 59,
     "valid: name, len"),
    (f"{S}<foo/></schema>", 1, 18, "unknown tag <foo> in a schema; valid: module, union, param"),
    (f'{S}<module name="a"><param name="p" len="0"/></module></schema>', 1, 51, "bad len '0'"),
    (f'{S}<module name="a"><param name="p" len="-3"/></module></schema>', 1, 51, "positive integer"),
    (f'{S}<module name="a"><param name="p" len="2.5"/></module></schema>', 1, 51, "bad len '2.5'"),
    (f'{S}<module name="a"><param name="p" len=""/></module></schema>', 1, 51, "empty 'len'"),
    (f'{S}<module name="a"><param name="p"/></module></schema>', 1, 35, "needs a 'len' attribute"),
    (f'{S}<module name="a"><param len="2"/></module></schema>', 1, 35, "needs a 'name' attribute"),
    (f'{S}<module name="a"><param name="p q" len="2"/></module></schema>', 1, 42,
     "invalid param name 'p q'"),
    (f'{S}<module name="a"><param name="p" len="1"/><param name="p" len="2"/></module></schema>',
     1, 60, "duplicate param 'p' in module 'a'"),
    (f'{S}<module name="a"><param name="p" len="1">x</param></module></schema>', 1, 35,
     "<param> must be empty"),
    (f'{S}<param name="p" len="1"/></schema>', 1, 18, "<param> outside a module"),
    (f'{S}<user><param name="p" len="1"/></user></schema>', 1, 24, "<param> outside a module"),
    (f'{S}<union><module name="a"/><user>x</user></union></schema>', 1, 43,
     "<user> inside <union>: a union holds only <module>s"),
    (f'{S}<union>\n  hi<module name="a"/></union></schema>', 2, 3, "text inside <union>"),
    (f"{S}<union>  </union></schema>", 1, 18, "empty <union>"),
    (f"{S}<system><user>x</user></system></schema>", 1, 26, "roles don't nest"),
]


@pytest.mark.parametrize(("src", "line", "column", "fragment"), SCHEMA_ERRORS)
def test_schema_errors(src: str, line: int, column: int, fragment: str) -> None:
    error = schema_error(src)
    assert fragment in error.message
    assert (error.line, error.column) == (line, column), error.message
    assert str(error).startswith(f"line {line}, column {column}: ")


P = '<prompt schema="trip">'  # 22 characters, so an import right after it is at column 23

PROMPT_ERRORS = [
    ('<prompt schema="nope"/>', 1, 9, "unknown schema 'nope'; known: trip"),
    ("<prompt></prompt>", 1, 1, "<prompt> needs a 'schema' attribute"),
    ('<prompt schema="trip" id="1"></prompt>', 1, 23, "unknown attribute 'id' on <prompt>"),
    ('<schema name="trip"></schema>', 1, 1, "expected the root <prompt>, found <schema>"),
    (f"{P}<rome/></prompt>", 1, 23,
     "unknown module 'rome' in schema 'trip'; valid at the top level: trip-plan, tokyo, paris, "
     "doc-1, doc-2 … and 3 more"),
    (f"{P}<tokyo><sushi/></tokyo></prompt>", 1, 30, "valid inside <tokyo>: tokyo-food"),
    (f"{P}<tokyo-food/></prompt>", 1, 23,
     "module 'tokyo-food' is nested in 'tokyo': import it inside <tokyo>…</tokyo>"),
    (f"{P}<paris><tokyo-food/></paris></prompt>", 1, 30, "nested in 'tokyo'"),
    (f"{P}<tokyo><doc-1/></tokyo></prompt>", 1, 30,
     "module 'doc-1' is a top-level module, not nested in 'tokyo'"),
    (f'{P}<trip-plan days="3"/></prompt>', 1, 34,
     "unknown parameter 'days' for module 'trip-plan'; valid: duration, city"),
    (f'{P}\n<doc-1 x="1"/></prompt>', 2, 8, "unknown parameter 'x' for module 'doc-1'; valid: none"),
    (f"{P}<doc-1/><doc-1/></prompt>", 1, 31, "module 'doc-1' imported twice (first at line 1, column 23)"),
    (f"{P}<tokyo><tokyo-food/><tokyo-food/></tokyo></prompt>", 1, 43, "imported twice"),
    (f"{P}<tokyo/>\n<paris/></prompt>", 2, 1,
     "modules 'tokyo' and 'paris' are in one <union>: import at most one"),
    (f"{P}<user>a<doc-1/></user></prompt>", 1, 30, "<doc-1> inside <user>: a prompt's roles hold only text"),
    (f"{P}<user x='1'>a</user></prompt>", 1, 29, "unknown attribute 'x' on <user>; valid: none"),
    (f"{P}<tokyo> x </tokyo></prompt>", 1, 31, "text inside import <tokyo>"),
    (f'{P}<trip-plan duration="3" duration="4"/></prompt>', 1, 47, "duplicate attribute 'duration'"),
    (f"{P}<doc-1>", 1, 30, "unclosed <doc-1> opened at line 1, column 23"),
    (f"{P}<user>1 < 2</user></prompt>", 1, 31, "invalid tag name"),
]


@pytest.mark.parametrize(("src", "line", "column", "fragment"), PROMPT_ERRORS)
def test_prompt_errors(src: str, line: int, column: int, fragment: str) -> None:
    error = prompt_error(src)
    assert fragment in error.message
    assert (error.line, error.column) == (line, column), error.message


def test_unescape_errors_point_into_the_string() -> None:
    with pytest.raises(PMLError) as info:
        unescape("ok\nthen &bogus; here")
    assert (info.value.line, info.value.column) == (2, 6)
    assert "bad entity '&bogus;'" in info.value.message


def test_pml_error_is_a_value_error() -> None:
    assert issubclass(PMLError, ValueError)
    assert isinstance(schema_error("<schema/>"), ValueError)


def test_prompt_pml_builds_parseable_escaped_prompts():
    from rag_promptcache.pml.build import prompt_pml

    schema = parse_schema('<schema name="s&amp;"><module name="a">x <param name="p" len="3"/></module></schema>')
    text = prompt_pml("s&", [("a", {"p": 'a<"b'})], [("user", "Q <&> ?")])
    prompt = parse_prompt(text, {"s&": schema})
    assert prompt.children[0].args == (("p", 'a<"b'),)
    assert prompt.children[1].children[0].text == "Q <&> ?"
    with pytest.raises(ValueError, match="valid: system, user, assistant"):
        prompt_pml("s&", [], [("tool", "x")])
