#!/usr/bin/env python3
"""Generate the Jinja interpreter's reference cases for tests/test_jinja.cpp, rendered by jinja2 in
transformers' own chat-template environment.

Rerun:  python3 tools/reference/make_jinja_cases.py   (needs transformers 5.17.0, jinja2 3.1.6)
Output: tests/fixtures/jinja/cases.json   {"variables": the default variables,
                                          "cases": [{name, source, variables?, expected}]}

Each source is compiled by transformers.utils.chat_template_utils._compile_jinja_template (the
ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks, loopcontrols, the tojson override,
raise_exception and strftime_now that apply_chat_template uses) and rendered with the case's
variables (the default ones unless it has its own). mb::jinja::Template must render the same text.
tools/fuzz.sh seeds its jinja target with these sources.
"""

import json
import os
import sys

import jinja2
import transformers
from transformers.utils.chat_template_utils import _compile_jinja_template

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "fixtures", "jinja", "cases.json")

VARIABLES = {
    "d": {"b": 2, "A": 1, "c": [1, 2]},
    "l": [3, 1, 2],
    "s": "  Hello World  ",
    "n": None,
    "u8": "h\u00e9llo w\u00f6rld",
}

# (name, source) rendered with VARIABLES; (name, source, variables) with their own.
CASES = [
    ('trim_blocks', '{% if true %}\nyes\n{% endif %}\nend'),
    ('lstrip_blocks', 'a\n    {% if true %}\n    b\n    {% endif %}\nc'),
    ('dash_strips_both_sides', 'a  \n  {%- if true -%}  \n  b  \n  {%- endif -%}  \n  c'),
    ('plus_disables_lstrip_and_trim', 'a\n    {%+ if true +%}\nb\n{% endif %}'),
    ('variable_tags_not_lstripped', "x\n    {{ 'v' }}\n    {{- 'w' -}}   \ny"),
    ('comments', 'a\n  {# note #}\nb{#- tight -#}  c {# keep #} d'),
    ('trailing_newline_dropped', 'text\n'),
    ('raw_block', '{% raw %}{{ not evaluated }} {% if %}{% endraw %}'),
    ('crlf_normalised', 'a\r\n{% if true %}\r\nb\r\n{% endif %}\r\n'),
    (
        'loop_scope_fresh_per_iteration',
        "{% for i in range(3) %}{% if i == 0 %}{% set x = 'a' %}{% endif %}[{{ x }}]{% endfor %}",
    ),
    ('loop_does_not_leak', '{% set x = 1 %}{% for i in range(2) %}{{ x }}{% set x = 2 %}{{ x }}{% endfor %}{{ x }}'),
    ('if_does_not_scope', '{% set x = 1 %}{% if true %}{% set x = 2 %}{% endif %}{{ x }}'),
    (
        'namespace_survives_loop',
        '{% set ns = namespace(total=0, seen=[]) %}{% for v in l %}{% set ns.total = ns.total + v %}{% '
        'endfor %}{{ ns.total }}',
    ),
    ('macro_late_binding', '{% macro m() %}{{ y }}{% endmacro %}{% set y = 5 %}{{ m() }}'),
    (
        'macro_locals_shadow',
        '{% macro m() %}{{ ns.a }}{% set ns = 3 %}{{ ns }}{% endmacro %}{% set ns = namespace(a=1) %}{{ '
        'm() }}{{ ns.a }}',
    ),
    (
        'macro_defaults_and_kwargs',
        '{% macro f(a, b=2, c=a) %}{{ a }}{{ b }}{{ c }}{% endmacro %}{{ f(1) }}|{{ f(1, 3) }}|{{ f(1, '
        'c=9) }}|{{ f() }}',
    ),
    (
        'macro_recursion',
        '{% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n * (fact(n - 1) | int) }}{% endif %}{% endmacro '
        '%}{{ fact(5) }}',
    ),
    (
        'set_block_and_filter_block',
        '{% set x %}  inner {{ 1 + 1 }} {% endset %}[{{ x }}]{% filter upper %}abc{% endfilter %}',
    ),
    ('tuple_unpack', '{% set a, b = [1, 2] %}{{ a }}{{ b }}{% for k, v in d | dictsort %}{{ k }}={{ v }};{% endfor %}'),
    (
        'loop_variables',
        '{% for x in l %}{{ loop.index }}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}{{ loop.length '
        "}}{{ loop.revindex }}{{ loop.previtem }}{{ loop.cycle('a','b') }};{% endfor %}",
    ),
    (
        'loop_filter_else_break_continue',
        '{% for x in l if x > 5 %}{{ x }}{% else %}empty{% endfor %}|{% for x in l %}{% if x == 1 %}{% '
        'break %}{% endif %}{{ x }}{% endfor %}|{% for x in l %}{% if x == 1 %}{% continue %}{% endif %}{{ '
        'x }}{% endfor %}',
    ),
    (
        'loop_over_dict_and_string',
        "{% for k in d %}{{ k }}{% endfor %}|{% for c in 'ab' %}{{ c }}.{% endfor %}|{% for k, v in "
        'd.items() %}{{ k }}{% endfor %}',
    ),
    ('range_negative_step', '{% for j in range(3, -1, -1) %}{{ j }}{% endfor %}'),
    ('python_str_of_values', '{{ [1, \'a\', none, true, 1.5, {\'k\': "it\'s"}] }} {{ d }} {{ n }} {{ true }}'),
    (
        'float_repr',
        '{{ 1e20 }} {{ 1e16 }} {{ 1e15 }} {{ 0.0001 }} {{ 0.00001 }} {{ 1.0 }} {{ 0.1 + 0.2 }} {{ 1 / 3 }} '
        '{{ -0.0 }}',
    ),
    (
        'arithmetic',
        "{{ 3 / 2 }} {{ 4 / 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 'ab' * 2 }} {{ "
        "[1] + [2] }} {{ 1 + true }} {{ '%s=%03d' % ('x', 7) }}",
    ),
    ('percent_format_flags', "{{ '[%+5s|%-4s|% 3r|%05s|%+.1s|%+05d|% .2f]' % ('a', 'b', 'c', 'd', 'ef', 7, 2.5) }}"),
    (
        'precedence',
        "{{ 'x' ~ 2 * 3 }} {{ not true or true }} {{ 1 if 0 else 2 if 0 else 3 }} {{ - 2 ** 2 }} {{ 'x' ~ "
        'l | length }} {{ 1 < 2 < 3 }}',
    ),
    (
        'equality_is_pythonic',
        "{{ true == 1 }} {{ 1 == 1.0 }} {{ [1, 2] == [1, 2.0] }} {{ 'a' != 'b' }} {{ none == none }}",
    ),
    ('membership', "{{ 'ell' in s }} {{ 'A' in d }} {{ 3 in l }} {{ 9 not in l }}"),
    (
        'indexing_and_slicing',
        '{{ l[0] }} {{ l[-1] }} {{ l[1:] }} {{ l[::-1] }} {{ u8[1:4] }} {{ u8[-1] }} {{ l.0 }} {{ '
        "d['c'][1] }} {{ d.b }}",
    ),
    ('missing_is_undefined', "[{{ d.zz }}][{{ d['zz'] }}][{{ l[10] }}][{{ 'x' if false }}]{{ d.zz is defined }}"),
    (
        'string_methods',
        "{{ s.strip() }}|{{ s.lstrip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ "
        "'abc'.startswith('ab') }}|{{ 'abc'.endswith(('x', 'c')) }}|{{ 'x-y'.replace('-', '+') }}|{{ "
        "'hello'.find('l') }}|{{ '-'.join(['a', 'b']) }}|{{ 'xxhixx'.strip('x') }}|{{ 'aBc'.upper() }}{{ "
        "'aBc'.lower() }}|{{ 'hello world'.title() }}",
    ),
    (
        'dict_methods',
        "{{ d.get('b') }} {{ d.get('zz') }} {{ d.get('zz', 0) }} {{ d.keys() | list }} {{ d.values() | "
        "list }} {{ d['items'] is mapping }}",
    ),
    (
        'string_filters',
        '{{ s | trim }}|{{ s | upper }}|{{ s | lower }}|{{ s | title }}|{{ s | capitalize }}|{{ s | '
        "replace('l', 'L') }}|{{ s | replace('l', 'L', 1) }}|{{ s | length }}|{{ u8 | length }}|{{ 5 | "
        'string }}',
    ),
    (
        'dictsort',
        "{{ {'B': 1, 'a': 2, 'A': 3} | dictsort | map('first') | join(',') }} {{ {'B': 1, 'a': 2} | "
        "dictsort(true) | map('last') | join(',') }} {{ {'x': 2, 'y': 1} | dictsort(by='value', "
        "reverse=true) | map('first') | join }}",
    ),
    (
        'list_filters',
        '{{ l | sort }} {{ l | sort(reverse=true) }} {{ l | min }} {{ l | max }} {{ l | sum }} {{ l | '
        "first }} {{ l | last }} {{ l | join('-') }} {{ l | reverse | list }} {{ [1, 1, 2] | unique | list "
        "}} {{ 'ab' | list }}",
    ),
    (
        'map_select',
        "{{ ['a', 'b'] | map('upper') | list }} {{ [{'a': 2}, {'a': 1, 'b': 1}] | map(attribute='a') | "
        "list }} {{ [{'a': 2}, {'a': 1, 'b': 1}] | selectattr('b') | list }} {{ [1, 2, 3, 4] | "
        "select('odd') | list }} {{ [1, 2, 3, 4] | reject('even') | list }} {{ [{'a': 2}, {'a': 1}] | "
        "rejectattr('a', 'equalto', 1) | list }} {{ [{'a': 2}, {'a': 1}] | sort(attribute='a') | "
        "map(attribute='a') | join }}",
    ),
    (
        'default_filter',
        "{{ zz | default('d') }} {{ n | default('d') }} {{ '' | default('d', true) }} {{ zz | d('e') }}",
    ),
    (
        'number_filters',
        "{{ '3' | int }} {{ '3.7' | int }} {{ 'x' | int }} {{ 'x' | int(5) }} {{ 3.9 | int }} {{ '2.5' | "
        'float }} {{ 2.567 | round(2) }} {{ 2.5 | round }} {{ -3 | abs }}',
    ),
    (
        'tojson',
        '{{ d | tojson }} {{ d | tojson(indent=2) }} {{ \'é\\n"\' | tojson }} {{ \'é\' | '
        "tojson(ensure_ascii=true) }} {{ d | tojson(sort_keys=true, separators=(',', ':')) }} {{ [] | "
        'tojson(indent=2) }} {{ 1.0 | tojson }}',
    ),
    (
        'indent_items_escape',
        "{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'a\\nb' | indent(2, true) }}|{{ d | items | list | length }}|{{ "
        '\'<a & "b">\' | e }}',
    ),
    (
        'tests',
        '{{ zz is defined }} {{ n is none }} {{ n is defined }} {{ 1.5 is float }} {{ 7 is integer }} {{ '
        'true is integer }} {{ true is number }} {{ 7 is odd }} {{ 8 is divisibleby(4) }} {{ l is sequence '
        "}} {{ d is sequence }} {{ d is mapping }} {{ s is string }} {{ 'x' is not string }} {{ true is "
        "boolean }} {{ range is callable }} {{ 2 is in l }} {{ 'ab' is lower }} {{ 3 is gt 2 }} {{ zz is "
        'iterable }} {{ 5 is iterable }}',
    ),
    (
        'undefined_is_forgiving',
        "[{{ zz }}][{{ zz | trim }}][{{ zz | length }}][{{ zz | list }}][{{ zz ~ 'x' }}][{{ 'x' in zz "
        '}}][{% for x in zz %}never{% endfor %}][{{ zz == zz }}]',
    ),
    ('globals', "{{ namespace(a=1).a }} {{ dict(a=1, b='x') }} {{ range(3) | list }}"),
    ('string_escapes', '{{ \'a\\tb\\\\c\\x41\\u00e9\' }} {{ "it\'s" }} {{ \'multi\' \'part\' }}'),
    ('generation_tag', '{% generation %}kept{% endgeneration %}'),
    # Integers at the edges of 64 bits, where Python's answer fits (tests/test_jinja.cpp checks
    # that what does not fit is an error).
    (
        'int64_edges',
        '{{ 1 ** 9223372036854775807 }} {{ (-1) ** 9223372036854775807 }} {{ 0 ** 9223372036854775807 }} '
        '{{ 2 ** 62 }} {{ (-9223372036854775807 - 1) % -1 }} {{ (-2) ** 63 }}',
    ),
    (
        'range_and_slice_steps_near_int64',
        '{{ range(-9223372036854775807, 9223372036854775807, 4611686018427387904) | list }} {{ '
        'l[1::9223372036854775807] }} {{ l[::-9223372036854775807] }}',
    ),
    ('repeat_nothing_many_times', "[{{ '' * 9223372036854775807 }}]{{ [] * 9223372036854775807 }}"),
    (
        'null_is_defined_missing_is_not',
        '{{ x is defined }} {{ x is none }} {{ x }}|{{ zz is defined }} {{ zz is none }} {{ zz }}',
        {'x': None},
    ),
    (
        'dict_order_is_insertion_order',
        '{{ m | tojson }}|{% for k, x in m.items() %}{{ k }}{% endfor %}',
        {'m': {'z': 1, 'a': 2}},
    ),
]


def main():
    cases = []
    for name, source, *own in CASES:
        variables = own[0] if own else VARIABLES
        case = {"name": name, "source": source}
        if own:
            case["variables"] = variables
        case["expected"] = _compile_jinja_template(source).render(**variables)
        cases.append(case)
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(
            {
                "generator": "tools/reference/make_jinja_cases.py",
                "transformers": transformers.__version__,
                "jinja2": jinja2.__version__,
                "variables": VARIABLES,
                "cases": cases,
            },
            f,
            ensure_ascii=False,
            indent=1,
        )
        f.write("\n")
    print(f"{len(cases)} cases -> {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
