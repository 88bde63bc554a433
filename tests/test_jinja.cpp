// Jinja interpreter unit tests. Expected outputs come from transformers' own Jinja environment
// (jinja2 3.1.6 via transformers.utils.chat_template_utils): tools/reference/make_jinja_cases.py
// writes them to tests/fixtures/jinja/cases.json.
#include <gtest/gtest.h>

#include <ctime>
#include <fstream>
#include <string>

#include "core/error.h"
#include "tokenizer/jinja.h"

namespace {

using mb::jinja::Json;
using mb::jinja::Template;

const Json& fixture() {
  static const Json f = [] {
    std::ifstream in(std::string(MARKBASE_SOURCE_DIR) + "/tests/fixtures/jinja/cases.json");
    return Json::parse(in);
  }();
  return f;
}

// The variables the cases render with unless they bring their own.
const Json& vars() { return fixture()["variables"]; }

TEST(JinjaTest, MatchesJinja2) {
  const Json& cases = fixture()["cases"];
  EXPECT_GE(cases.size(), 50u);
  for (const Json& c : cases) {
    SCOPED_TRACE(c["name"].get<std::string>());
    try {
      EXPECT_EQ(Template(c["source"].get<std::string>()).render(c.value("variables", vars())),
                c["expected"].get<std::string>());
    } catch (const mb::Error& e) {
      ADD_FAILURE() << e.what();
    }
  }
}

// Runs `source` and returns the error message, or "" if it rendered.
std::string error_of(const std::string& source, const Json& v = Json::object()) {
  try {
    Template(source).render(v);
  } catch (const mb::Error& e) {
    return e.what();
  }
  return "";
}

void expect_error(const std::string& source, const std::string& line, const std::string& text) {
  std::string err = error_of(source);
  EXPECT_NE(err.find("chat template line " + line + ":"), std::string::npos) << source << "\n -> " << err;
  EXPECT_NE(err.find(text), std::string::npos) << source << "\n -> " << err;
}

TEST(JinjaTest, UnsupportedConstructsNameTheLine) {
  expect_error("ok\n{% include 'other.jinja' %}", "2", "'include' tags are not supported");
  expect_error("{% extends 'base' %}", "1", "'extends' tags are not supported");
  expect_error("a\nb\n{% call m() %}x{% endcall %}", "3", "'call' tags are not supported");
  expect_error("{% for x in y recursive %}{% endfor %}", "1", "recursive loops are not supported");
  expect_error("\n{{ x | wordwrap }}", "2", "unsupported filter 'wordwrap'");
  expect_error("{% if x is prime %}{% endif %}", "1", "unsupported test 'prime'");
  expect_error("{{ f(*args) }}", "1", "*args and **kwargs");
  expect_error("{% frobnicate %}", "1", "unknown or misplaced tag 'frobnicate'");
}

TEST(JinjaTest, SyntaxErrorsNameTheLine) {
  expect_error("line\n{% if true %}\nnever closed", "2", "'if' is never closed");
  expect_error("{% endif %}", "1", "misplaced tag 'endif'");
  expect_error("\n\n{{ 'unterminated }}", "3", "unterminated string");
  expect_error("{{ (1 }}", "1", "expected ')'");
  expect_error("{# open comment", "1", "missing end of comment");
  expect_error("{% break %}", "1", "'break' outside of a loop");
}

TEST(JinjaTest, RuntimeErrorsNameTheLine) {
  expect_error("a\n\n{{ 'a' ~ 1 + 2 }}", "3", "unsupported operand type(s) for +: 'str' and 'int'");
  expect_error("{{ missing.attr }}", "1", "'missing' is undefined");
  expect_error("{% set x = 1 %}\n{% set x.y = 2 %}", "2", "non-namespace");
  expect_error("{{ 1 // 0 }}", "1", "division or modulo by zero");
  expect_error("{{ [1, 2] | dictsort }}", "1", "dictsort requires a mapping");
  expect_error("{% macro m(a) %}\n{{ a.b.c }}\n{% endmacro %}{{ m({}) }}", "2", "'b' is undefined");
  expect_error("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", "1", "takes not more than 1 argument");
  expect_error("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", "1", "recursed more than");
  expect_error("{{ range(1000000) | length }}", "1", "range too big");
}

TEST(JinjaTest, RaiseException) {
  std::string err = error_of("{% if true %}\n{{ raise_exception('Roles must alternate') }}{% endif %}");
  EXPECT_NE(err.find("line 2: raise_exception: Roles must alternate"), std::string::npos) << err;
}

TEST(JinjaTest, StrftimeNow) {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  std::string year = std::to_string(tm.tm_year + 1900);
  std::string out = Template("{{ strftime_now('%Y') }}").render(Json::object());
  EXPECT_TRUE(out == year || out == std::to_string(tm.tm_year + 1901)) << out;  // new year's eve
}

// A template renders the same after earlier renders, and so does a copy of it.
TEST(JinjaTest, TemplateIsReusable) {
  const std::string source =
      "{% set ns = namespace(n=0) %}{% for x in xs %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}";
  Template t(source);
  Template copy = t;
  for (const Json& v : {Json{{"xs", {1, 2, 3}}}, Json{{"xs", {4}}}, Json{{"xs", Json::array()}}}) {
    const std::string fresh = Template(source).render(v);
    EXPECT_EQ(t.render(v), fresh);
    EXPECT_EQ(copy.render(v), fresh);
  }
}

TEST(JinjaTest, VariablesMustBeAnObject) { EXPECT_THROW(Template("x").render(Json::array()), mb::Error); }

// ---- bounds: what tools/fuzz.sh found (a stack overflow, a hang, runaway memory or undefined
// behaviour each), now an mb::Error or the right answer.

std::string repeat(const std::string& s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += s;
  return out;
}

TEST(JinjaBounds, DeepNestingIsAnErrorNotAStackOverflow) {
  for (const std::string& source :
       {"{{ " + repeat("(", 6000) + "1" + repeat(")", 6000) + " }}",
        "{{ " + repeat("[", 6000) + repeat("]", 6000) + " }}",
        "{{ " + repeat("-", 12000) + "1 }}", "{{ " + repeat("not ", 3000) + "1 }}",
        repeat("{% if true %}", 1200) + "x" + repeat("{% endif %}", 1200), "{{ " + repeat("1 + ", 7000) + "1 }}",
        "{{ d" + repeat(".a", 7000) + " }}", "{{ 1" + repeat(" | string", 1500) + " }}"}) {
    std::string err = error_of(source);
    EXPECT_NE(err.find("levels deep"), std::string::npos) << source.substr(0, 40) << " -> " << err;
  }
  // Just inside the bounds still works.
  EXPECT_EQ(Template("{{ " + repeat("(", 200) + "1" + repeat(")", 200) + " }}").render(Json::object()), "1");
}

TEST(JinjaBounds, DeepDataIsAnError) {
  Json deep = Json::array();
  for (int i = 0; i < 600; ++i) deep = Json::array({deep});
  EXPECT_THROW(Template("{{ x }}").render(Json{{"x", deep}}), mb::Error);
  EXPECT_NE(error_of("{% set ns = namespace(x=[]) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}"),
            "");
}

// Limits small enough that a runaway render fails in milliseconds; the previous ones after.
struct SmallLimits {
  mb::jinja::RenderLimits prev = mb::jinja::set_render_limits({100000, 1 << 20});
  ~SmallLimits() { mb::jinja::set_render_limits(prev); }
};

TEST(JinjaBounds, RunawayRendersStopAtTheLimits) {
  SmallLimits limits;
  const char* steps = "takes more than 100000 steps";
  const char* bytes = "builds more than 1 MB of values";
  const std::pair<const char*, const char*> cases[] = {
      {"{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}", steps},
      {"{% macro m(n) %}{% if n > 0 %}{{ m(n-1) }}{{ m(n-1) }}{% endif %}{% endmacro %}{{ m(60) }}", steps},
      {"{% set ns = namespace(x=[1]) %}{% for i in range(60) %}{% set ns.x = ns.x + ns.x %}{% endfor %}", bytes},
      {"{% set ns = namespace(x='ab') %}{% for i in range(60) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}", bytes},
      {"{{ 'a' * 2000000000 }}", bytes},
      {"{{ range(1000) | join('x' * 10000) }}", bytes},
      {"{{ 'a\\nb' | indent(2000000000) }}", bytes},
      {"{{ d | tojson(indent=2000000000) }}", bytes},
      {"{{ '%999999999d' % 1 }}", bytes},
      {"{{ ('x' * 200000) | replace('', 'yyyyyyyy') }}", bytes},
      {"{{ range(20000) | unique | list }}", steps},
  };
  for (const auto& [source, want] : cases) {
    std::string err = error_of(source, vars());
    EXPECT_NE(err.find(want), std::string::npos) << source << " -> " << err;
  }
}

TEST(JinjaBounds, DefaultLimitsAreWhereTheHeaderSaysAndSettable) {
  const mb::jinja::RenderLimits d;
  EXPECT_EQ(mb::jinja::render_limits().steps, d.steps);
  EXPECT_EQ(mb::jinja::render_limits().bytes, d.bytes);
  {
    SmallLimits limits;
    EXPECT_EQ(mb::jinja::render_limits().steps, 100000);
  }
  EXPECT_EQ(mb::jinja::render_limits().steps, d.steps);
  EXPECT_THROW(mb::jinja::set_render_limits({0, 1}), mb::Error);
}

// Integers are 64-bit here (Python's are unbounded): what does not fit is an error, never
// undefined behaviour (what fits is checked against jinja2: the int64_* cases of the fixture).
TEST(JinjaBounds, IntegerOverflowIsAnError) {
  for (const char* source :
       {"{{ (-9223372036854775807 - 1) // -1 }}", "{{ -(-9223372036854775807 - 1) }}",
        "{{ (-9223372036854775807 - 1) | abs }}", "{{ 2 ** 63 }}", "{{ 1e300 | int }}",
        "{{ '99999999999999999999999' | int }}", "{{ d.99999999999999999999999 }}",
        "{{ [d] | map(attribute='99999999999999999999999') | list }}", "{{ '%99999999999999999999d' % 1 }}",
        "{{ '%.99999999999999999999s' % 'x' }}"}) {
    EXPECT_NE(error_of(source, vars()), "") << source;
  }
}

}  // namespace
