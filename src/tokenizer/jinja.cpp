// Jinja2 subset interpreter; see jinja.h for scope. The lexer, parser and evaluator mirror
// jinja2 3.1's own (lexer.py, parser.py, runtime.py) closely enough to be byte-exact on
// whitespace handling, because chat templates live or die by it.
#include "tokenizer/jinja.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstring>
#include <ctime>
#include <functional>
#include <map>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "core/error.h"
#include "core/utf8.h"

namespace mb::jinja {
namespace {

// Raised by evaluation helpers that do not know where they are; the innermost expression or
// statement being evaluated catches it and rethrows an mb::Error naming its template line.
struct EvalError {
  std::string msg;
};

template <class... A>
[[noreturn]] void raise(fmt::format_string<A...> f, A&&... a) {
  throw EvalError{fmt::format(f, std::forward<A>(a)...)};
}

// ---------------------------------------------------------------------------------------------
// Bounds. A server renders what users send, and a model file brings its own template: no
// template or input may take unbounded time, memory or stack. Real chat templates stay far below
// each bound.

// Brackets, unary operators, blocks and operator chains nest by recursion in the parser, and the
// expression and statement trees by recursion when rendered and destroyed.
constexpr int kMaxNesting = 256;
// Lists and dicts nest by recursion in repr, tojson and comparisons (Python's json module stops
// near 1000 levels).
constexpr int kMaxDataDepth = 512;
// Expressions and macro calls being evaluated inside one another (recursion in the renderer).
constexpr int kMaxEvalDepth = 1000;

// What the running render may still spend (set_render_limits); null outside renders.
struct Meter {
  int64_t steps, bytes;
  RenderLimits limits;
};
thread_local Meter* t_meter = nullptr;

void count_steps(int64_t n) {
  if (t_meter && (t_meter->steps -= n) < 0)
    raise("rendering takes more than {} steps: the template loops or recurses without end", t_meter->limits.steps);
}
void count_bytes(int64_t n) {
  if (t_meter && (t_meter->bytes -= n) < 0)
    raise("rendering builds more than {} MB of values: the template grows a value without end",
          t_meter->limits.bytes >> 20);
}
// count x size, saturating (such a product only matters when it exceeds a limit).
int64_t cost_of(int64_t count, int64_t size) {
  constexpr int64_t kCap = INT64_MAX >> 2;
  return size > 0 && count > kCap / size ? kCap : count * size;
}

// ---------------------------------------------------------------------------------------------
// Text: Python strings index and strip by code point, so UTF-8 is decoded where it matters.

// An ill-formed byte reads as U+FFFD of length 1.
char32_t decode_at(std::string_view s, size_t i, size_t* len) { return utf8_decode_lenient(s, i, len); }

std::u32string to_u32(std::string_view s) {
  count_steps(int64_t(s.size()) / 64);
  std::u32string r;
  r.reserve(s.size());
  for (size_t i = 0, n; i < s.size(); i += n) r.push_back(decode_at(s, i, &n));
  return r;
}

std::string to_u8(std::u32string_view s) {
  std::string r;
  r.reserve(s.size());
  for (char32_t c : s) utf8_append(r, c);
  return r;
}

bool is_ascii(std::string_view s) {
  count_steps(int64_t(s.size()) / 64);
  return std::all_of(s.begin(), s.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; });
}

// Python's str.isspace(), which is what strip(), split() and the lexer's \s use.
bool py_space(char32_t c) {
  return (c >= 9 && c <= 13) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

size_t skip_space(std::string_view s, size_t i) {
  for (size_t n; i < s.size(); i += n)
    if (!py_space(decode_at(s, i, &n))) break;
  return i;
}

// Length of `s` without trailing Python whitespace.
size_t rstrip_len(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    size_t n;
    if (!py_space(decode_at(s, start, &n))) break;
    end = start;
  }
  return end;
}

enum StripSide { kLeft = 1, kRight = 2, kBoth = 3 };

std::string py_strip(std::string_view s, int sides, const std::u32string* chars = nullptr) {
  if (!chars) {  // whitespace: scan the ends without decoding the middle
    size_t e = sides & kRight ? rstrip_len(s) : s.size();
    size_t b = sides & kLeft ? std::min(skip_space(s, 0), e) : 0;
    return std::string(s.substr(b, e - b));
  }
  std::u32string u = to_u32(s);
  count_steps(cost_of(int64_t(u.size()), int64_t(chars->size()) / 64 + 1) / 8);
  auto drop = [&](char32_t c) { return chars->find(c) != std::u32string::npos; };
  size_t b = 0, e = u.size();
  if (sides & kLeft)
    while (b < e && drop(u[b])) ++b;
  if (sides & kRight)
    while (e > b && drop(u[e - 1])) --e;
  return to_u8(std::u32string_view(u).substr(b, e - b));
}

// Case mapping covers ASCII only (documented limitation; template keywords are ASCII).
std::string ascii_upper(std::string s) {
  for (char& c : s)
    if (c >= 'a' && c <= 'z') c -= 32;
  return s;
}
std::string ascii_lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c += 32;
  return s;
}
bool is_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

// Python's float.__repr__: shortest round-trip digits, scientific outside [1e-4, 1e16).
std::string py_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string s(buf, res.ptr);
  std::string out;
  if (s[0] == '-') {
    out = "-";
    s.erase(0, 1);
  }
  size_t epos = s.find('e');
  int exp = std::stoi(s.substr(epos + 1));
  std::string digits = s.substr(0, epos);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  if (exp >= -4 && exp < 16) {
    if (exp < 0) {
      out += "0." + std::string(-exp - 1, '0') + digits;
    } else if (static_cast<int>(digits.size()) <= exp + 1) {
      out += digits + std::string(exp + 1 - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
    }
  } else {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    out += fmt::format("e{}{:02d}", exp < 0 ? '-' : '+', std::abs(exp));
  }
  return out;
}

// Approximates str.isprintable() for repr(): controls, separators and format characters.
bool py_printable(char32_t c) {
  if (c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD || c == 0x1680) return false;
  if ((c >= 0x2000 && c <= 0x200F) || (c >= 0x2028 && c <= 0x202F) || (c >= 0x205F && c <= 0x2064)) return false;
  if (c == 0x3000 || c == 0xFEFF || (c >= 0xD800 && c <= 0xF8FF) || (c >= 0xFFF9 && c <= 0xFFFB)) return false;
  return true;
}

std::string py_repr_str(std::string_view s) {
  bool sq = s.find('\'') != std::string_view::npos, dq = s.find('"') != std::string_view::npos;
  char q = sq && !dq ? '"' : '\'';
  std::string out(1, q);
  for (char32_t c : to_u32(s)) {
    if (c == static_cast<char32_t>(q) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (py_printable(c)) {
      utf8_append(out, c);
    } else if (c <= 0xFF) {
      out += fmt::format("\\x{:02x}", static_cast<unsigned>(c));
    } else if (c <= 0xFFFF) {
      out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
    } else {
      out += fmt::format("\\U{:08x}", static_cast<unsigned>(c));
    }
  }
  return out + q;
}

// ---------------------------------------------------------------------------------------------
// Values

bool is_num(const Json& j) { return j.is_number() || j.is_boolean(); }
bool is_int(const Json& j) { return j.is_boolean() || j.is_number_integer(); }
int64_t as_int(const Json& j) {
  if (j.is_boolean()) return j.get<bool>() ? 1 : 0;
  if (j.is_number_unsigned()) return static_cast<int64_t>(j.get<uint64_t>());
  if (j.is_number_integer()) return j.get<int64_t>();
  const double d = j.get<double>();
  if (!(d >= -0x1p63 && d < 0x1p63)) raise("cannot convert float {} to an integer", py_float(d));
  return static_cast<int64_t>(d);
}

// The bytes of a value (16 per element, and its strings' bytes) for count_bytes(); fails past
// kMaxDataDepth levels of lists and dicts. Walks with its own stack: inputs may be deep.
int64_t json_cost(const Json& root) {
  if (!root.is_structured()) return 16 + (root.is_string() ? int64_t(root.get_ref<const std::string&>().size()) : 0);
  int64_t cost = 16;
  std::vector<std::pair<const Json*, int>> todo = {{&root, 0}};  // lists and dicts still to walk
  while (!todo.empty()) {
    auto [j, depth] = todo.back();
    todo.pop_back();
    if (depth == kMaxDataDepth) raise("lists and dicts nested more than {} levels deep", kMaxDataDepth);
    for (auto it = j->begin(); it != j->end(); ++it) {
      if (j->is_object()) cost += int64_t(it.key().size());
      cost += 16;
      if (it->is_string()) cost += int64_t(it->get_ref<const std::string&>().size());
      if (it->is_structured()) todo.emplace_back(&*it, depth + 1);
    }
  }
  return cost;
}
double as_double(const Json& j) { return j.is_boolean() ? (j.get<bool>() ? 1.0 : 0.0) : j.get<double>(); }

std::string_view json_type_name(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null: return "NoneType";
    case Json::value_t::boolean: return "bool";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned: return "int";
    case Json::value_t::number_float: return "float";
    case Json::value_t::string: return "str";
    case Json::value_t::array: return "list";
    case Json::value_t::object: return "dict";
    default: return "object";
  }
}

std::string repr(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null: return "None";
    case Json::value_t::boolean: return j.get<bool>() ? "True" : "False";
    case Json::value_t::number_integer: return std::to_string(j.get<int64_t>());
    case Json::value_t::number_unsigned: return std::to_string(j.get<uint64_t>());
    case Json::value_t::number_float: return py_float(j.get<double>());
    case Json::value_t::string: return py_repr_str(j.get_ref<const std::string&>());
    case Json::value_t::array: {
      std::string out = "[";
      for (size_t i = 0; i < j.size(); ++i) out += (i ? ", " : "") + repr(j[i]);
      return out + "]";
    }
    case Json::value_t::object: {
      std::string out = "{";
      bool first = true;
      for (auto it = j.begin(); it != j.end(); ++it, first = false)
        out += (first ? "" : ", ") + py_repr_str(it.key()) + ": " + repr(it.value());
      return out + "}";
    }
    default: return "<binary>";
  }
}

struct Renderer;
struct NamespaceObj;
struct CallableObj;
struct LoopObj;

struct Value {
  enum class Kind : uint8_t { Undefined, Data, Namespace, Callable, Loop };
  Kind kind = Kind::Undefined;
  // Data values point into a shared, never-mutated JSON tree, so indexing into a big message
  // list costs a refcount, not a copy.
  std::shared_ptr<const Json> owner;
  const Json* node = nullptr;
  std::shared_ptr<NamespaceObj> ns;
  std::shared_ptr<CallableObj> fn;
  std::shared_ptr<LoopObj> loop;
  std::string hint;  // Undefined: the name that was looked up, for error messages

  static Value undef(std::string hint) {
    Value v;
    v.hint = std::move(hint);
    return v;
  }
  static Value of(Json j) {
    if (t_meter) count_bytes(json_cost(j));
    Value v;
    v.kind = Kind::Data;
    v.owner = std::make_shared<const Json>(std::move(j));
    v.node = v.owner.get();
    return v;
  }
  Value child(const Json& sub) const {
    Value v;
    v.kind = Kind::Data;
    v.owner = owner;
    v.node = &sub;
    return v;
  }
  bool data() const { return kind == Kind::Data; }
  bool undefined() const { return kind == Kind::Undefined; }
  const Json& j() const { return *node; }
  bool is_str() const { return data() && node->is_string(); }
  const std::string& str() const { return node->get_ref<const std::string&>(); }
};

struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
};
struct NamespaceObj {
  std::map<std::string, Value> attrs;
};
struct CallableObj {
  std::string name;
  std::function<Value(Renderer&, const Args&)> call;
};
struct LoopObj {
  std::shared_ptr<const std::vector<Value>> items;
  size_t index = 0;
};

const Value& bool_value(bool b) {
  static const Value t = Value::of(true), f = Value::of(false);
  return b ? t : f;
}
const Value& none_value() {
  static const Value n = Value::of(nullptr);
  return n;
}

Value make_callable(std::string name, std::function<Value(Renderer&, const Args&)> f) {
  Value v;
  v.kind = Value::Kind::Callable;
  v.fn = std::make_shared<CallableObj>(CallableObj{std::move(name), std::move(f)});
  return v;
}

std::string_view type_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return "Undefined";
    case Value::Kind::Namespace: return "Namespace";
    case Value::Kind::Callable: return "function";
    case Value::Kind::Loop: return "LoopContext";
    case Value::Kind::Data: return json_type_name(v.j());
  }
  return "object";
}

[[noreturn]] void raise_undefined(const Value& v) { raise("'{}' is undefined", v.hint); }

Json to_json(const Value& v) {
  if (v.data()) {
    if (t_meter) count_bytes(json_cost(v.j()));  // before the copy
    return v.j();
  }
  if (v.undefined()) raise_undefined(v);
  raise("a {} cannot be stored in a list or dict here", type_name(v));
}

// Python str().
std::string to_str(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return "";
    case Value::Kind::Data: return v.j().is_string() ? v.str() : repr(v.j());
    case Value::Kind::Namespace: return "<Namespace>";
    case Value::Kind::Callable: return "<function " + v.fn->name + ">";
    case Value::Kind::Loop: return "<LoopContext>";
  }
  return "";
}

bool truthy(const Value& v) {
  if (v.undefined()) return false;
  if (!v.data()) return true;
  const Json& j = v.j();
  switch (j.type()) {
    case Json::value_t::null: return false;
    case Json::value_t::boolean: return j.get<bool>();
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned: return as_int(j) != 0;
    case Json::value_t::number_float: return j.get<double>() != 0.0;
    case Json::value_t::string:
      return !j.get_ref<const std::string&>().empty();  // json::empty() is false for any string
    case Json::value_t::array:
    case Json::value_t::object: return !j.empty();
    default: return true;
  }
}

// Python ==: numbers compare by value across bool/int/float; containers deeply.
bool json_eq(const Json& a, const Json& b) {
  count_steps(1);
  if (is_num(a) && is_num(b)) return is_int(a) && is_int(b) ? as_int(a) == as_int(b) : as_double(a) == as_double(b);
  if (a.type() != b.type()) return false;
  if (a.is_array()) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (!json_eq(a[i], b[i])) return false;
    return true;
  }
  if (a.is_object()) {
    if (a.size() != b.size()) return false;
    for (auto it = a.begin(); it != a.end(); ++it) {
      auto other = b.find(it.key());
      if (other == b.end() || !json_eq(it.value(), *other)) return false;
    }
    return true;
  }
  return a == b;
}

bool py_eq(const Value& a, const Value& b) {
  if (a.data() && b.data()) return json_eq(a.j(), b.j());
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::Undefined: return true;
    case Value::Kind::Namespace: return a.ns == b.ns;
    case Value::Kind::Callable: return a.fn == b.fn;
    case Value::Kind::Loop: return a.loop == b.loop;
    default: return false;
  }
}

// Python ordering (<): numbers, strings (UTF-8 byte order is code point order), lists.
int json_cmp(const Json& a, const Json& b) {
  if (is_num(a) && is_num(b)) {
    if (is_int(a) && is_int(b)) return as_int(a) < as_int(b) ? -1 : as_int(a) > as_int(b) ? 1 : 0;
    double x = as_double(a), y = as_double(b);
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) {
    int c = a.get_ref<const std::string&>().compare(b.get_ref<const std::string&>());
    return c < 0 ? -1 : c > 0 ? 1 : 0;
  }
  if (a.is_array() && b.is_array()) {
    for (size_t i = 0; i < a.size() && i < b.size(); ++i)
      if (!json_eq(a[i], b[i])) return json_cmp(a[i], b[i]);
    return a.size() < b.size() ? -1 : a.size() > b.size() ? 1 : 0;
  }
  raise("'<' not supported between instances of '{}' and '{}'", json_type_name(a), json_type_name(b));
}

int value_cmp(const Value& a, const Value& b) {
  if (a.undefined()) raise_undefined(a);
  if (b.undefined()) raise_undefined(b);
  if (!a.data() || !b.data()) raise("'<' not supported between instances of '{}' and '{}'", type_name(a), type_name(b));
  return json_cmp(a.j(), b.j());
}

std::vector<Value> iterate(const Value& v) {
  std::vector<Value> out;
  if (v.undefined()) return out;
  if (!v.data()) raise("'{}' object is not iterable", type_name(v));
  const Json& j = v.j();
  if (j.is_structured()) count_steps(int64_t(j.size()));
  if (j.is_array()) {
    out.reserve(j.size());
    for (const Json& e : j) out.push_back(v.child(e));
  } else if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) out.push_back(Value::of(it.key()));
  } else if (j.is_string()) {
    for (char32_t c : to_u32(v.str())) out.push_back(Value::of(to_u8(std::u32string(1, c))));
  } else {
    raise("'{}' object is not iterable", json_type_name(j));
  }
  return out;
}

Value list_value(const std::vector<Value>& items) {
  Json arr = Json::array();
  for (const Value& v : items) arr.push_back(to_json(v));
  return Value::of(std::move(arr));
}

int64_t py_len(const Value& v) {
  if (v.undefined()) return 0;
  if (v.data()) {
    const Json& j = v.j();
    if (j.is_string()) return is_ascii(v.str()) ? v.str().size() : to_u32(v.str()).size();
    if (j.is_array() || j.is_object()) return j.size();
  }
  raise("object of type '{}' has no len()", type_name(v));
}

bool contains(const Value& container, const Value& item) {
  if (container.undefined()) return false;
  if (!container.data()) raise("argument of type '{}' is not iterable", type_name(container));
  const Json& c = container.j();
  if (c.is_string()) {
    if (!item.is_str()) raise("'in <string>' requires string as left operand, not {}", type_name(item));
    count_steps(cost_of(int64_t(c.get_ref<const std::string&>().size()), int64_t(item.str().size()) / 64 + 1) / 8);
    return c.get_ref<const std::string&>().find(item.str()) != std::string::npos;
  }
  if (c.is_array()) {
    for (const Json& e : c)
      if (py_eq(item, container.child(e))) return true;
    return false;
  }
  if (c.is_object()) return item.is_str() && c.contains(item.str());
  raise("argument of type '{}' is not iterable", json_type_name(c));
}

// ---------------------------------------------------------------------------------------------
// Attribute and item lookup, following SandboxedEnvironment.getattr/getitem: `d.get` is the
// dict method, `d['items']` falls back to the method when the key is missing.

bool is_dict_method(std::string_view n) { return n == "items" || n == "keys" || n == "values" || n == "get"; }
bool is_str_method(std::string_view n) {
  static const char* names[] = {"strip",   "lstrip",  "rstrip",     "split",   "startswith", "endswith", "upper",
                                "lower",   "title",   "capitalize", "replace", "find",       "count",    "join",
                                "isdigit", "isalpha", "isspace",    "isalnum", "islower",    "isupper"};
  return std::any_of(std::begin(names), std::end(names), [&](const char* m) { return n == m; });
}

Value call_method(const Value& self, const std::string& name, const Args& a);

Value bound_method(const Value& self, const std::string& name) {
  return make_callable(name, [self, name](Renderer&, const Args& a) { return call_method(self, name, a); });
}

Value loop_attr(const LoopObj& l, const std::string& name) {
  int64_t i = l.index, n = l.items->size();
  if (name == "index") return Value::of(i + 1);
  if (name == "index0") return Value::of(i);
  if (name == "revindex") return Value::of(n - i);
  if (name == "revindex0") return Value::of(n - i - 1);
  if (name == "first") return bool_value(i == 0);
  if (name == "last") return bool_value(i == n - 1);
  if (name == "length") return Value::of(n);
  if (name == "depth") return Value::of(1);
  if (name == "depth0") return Value::of(0);
  if (name == "previtem") return i > 0 ? (*l.items)[i - 1] : Value::undef("previtem");
  if (name == "nextitem") return i + 1 < n ? (*l.items)[i + 1] : Value::undef("nextitem");
  if (name == "cycle")
    return make_callable("cycle", [i](Renderer&, const Args& a) {
      if (a.pos.empty()) raise("no items for cycling given");
      return a.pos[i % a.pos.size()];
    });
  return Value::undef("loop." + name);
}

Value get_attr(const Value& obj, const std::string& name) {
  switch (obj.kind) {
    case Value::Kind::Undefined: raise_undefined(obj);
    case Value::Kind::Namespace: {
      auto it = obj.ns->attrs.find(name);
      return it == obj.ns->attrs.end() ? Value::undef(name) : it->second;
    }
    case Value::Kind::Loop: return loop_attr(*obj.loop, name);
    case Value::Kind::Callable: return Value::undef(name);
    case Value::Kind::Data: break;
  }
  const Json& j = obj.j();
  if (j.is_object()) {
    if (is_dict_method(name)) return bound_method(obj, name);
    auto it = j.find(name);
    return it == j.end() ? Value::undef(name) : obj.child(*it);
  }
  if (j.is_string() && is_str_method(name)) return bound_method(obj, name);
  return Value::undef(name);
}

Value get_item(const Value& obj, const Value& key) {
  if (obj.undefined()) raise_undefined(obj);
  if (!obj.data()) return key.is_str() ? get_attr(obj, key.str()) : Value::undef("item");
  const Json& j = obj.j();
  if (j.is_object()) {
    if (!key.is_str()) return Value::undef(key.data() ? repr(key.j()) : "item");
    auto it = j.find(key.str());
    if (it != j.end()) return obj.child(*it);
    return is_dict_method(key.str()) ? bound_method(obj, key.str()) : Value::undef(key.str());
  }
  bool int_key = key.data() && is_int(key.j());
  if (j.is_array() && int_key) {
    int64_t i = as_int(key.j()), n = j.size();
    if (i < 0) i += n;
    return i >= 0 && i < n ? obj.child(j[i]) : Value::undef(fmt::format("index {}", i));
  }
  if (j.is_string() && int_key) {
    std::u32string u = to_u32(obj.str());
    int64_t i = as_int(key.j()), n = u.size();
    if (i < 0) i += n;
    return i >= 0 && i < n ? Value::of(to_u8(u.substr(i, 1))) : Value::undef(fmt::format("index {}", i));
  }
  if (j.is_string() && key.is_str() && is_str_method(key.str())) return bound_method(obj, key.str());
  return Value::undef(key.is_str() ? key.str() : "item");
}

std::optional<int64_t> slice_bound(const Value& v) {
  if (v.undefined() || (v.data() && v.j().is_null())) return std::nullopt;
  if (!v.data() || !is_int(v.j())) raise("slice indices must be integers or None");
  return as_int(v.j());
}

// Python slice semantics (PySlice_AdjustIndices): returns the selected positions.
std::vector<int64_t> slice_positions(int64_t len, std::optional<int64_t> start, std::optional<int64_t> stop,
                                     std::optional<int64_t> step_opt) {
  int64_t step = step_opt.value_or(1);
  if (step == 0) raise("slice step cannot be zero");
  int64_t lower = step < 0 ? -1 : 0, upper = step < 0 ? len - 1 : len;
  auto adjust = [&](std::optional<int64_t> v, int64_t dflt) {
    if (!v) return dflt;
    int64_t x = *v < 0 ? *v + len : *v;
    return std::clamp(x, lower, upper);
  };
  int64_t b = adjust(start, step < 0 ? upper : lower), e = adjust(stop, step < 0 ? lower : upper);
  std::vector<int64_t> out;
  for (int64_t i = b; step > 0 ? i < e : i > e;) {
    out.push_back(i);
    if (__builtin_add_overflow(i, step, &i)) break;
  }
  return out;
}

Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  if (obj.undefined()) raise_undefined(obj);
  if (!obj.data()) return Value::undef("slice");
  const Json& j = obj.j();
  if (j.is_array()) {
    Json out = Json::array();
    for (int64_t i : slice_positions(j.size(), slice_bound(start), slice_bound(stop), slice_bound(step)))
      out.push_back(j[i]);
    return Value::of(std::move(out));
  }
  if (j.is_string()) {
    std::u32string u = to_u32(obj.str()), out;
    for (int64_t i : slice_positions(u.size(), slice_bound(start), slice_bound(stop), slice_bound(step))) out += u[i];
    return Value::of(to_u8(out));
  }
  return Value::undef("slice");
}

// ---------------------------------------------------------------------------------------------
// Arithmetic with Python semantics (int stays int, / is true division, // and % floor).

// printf-style "fmt % args" (Python's str.__mod__) for the common conversions.
std::string percent_format(const std::string& f, const Value& rhs) {
  size_t specs = 0;
  for (size_t i = 0; i + 1 < f.size(); ++i)
    if (f[i] == '%') f[i + 1] == '%' ? (void)++i : (void)++specs;
  // Tuples are lists here, so a list is taken as the argument tuple unless exactly one
  // conversion wants it whole.
  std::vector<Value> args = rhs.data() && rhs.j().is_array() && specs != 1 ? iterate(rhs) : std::vector<Value>{rhs};
  std::string out;
  size_t next = 0;
  for (size_t i = 0; i < f.size(); ++i) {
    if (f[i] != '%') {
      out += f[i];
      continue;
    }
    size_t j = i + 1;
    std::string flags;
    while (j < f.size() && std::strchr("-+ 0#", f[j])) flags += f[j++];
    size_t w0 = j;
    while (j < f.size() && is_digit(f[j])) ++j;
    std::string width = f.substr(w0, j - w0), prec;
    if (j < f.size() && f[j] == '.') {
      size_t p0 = ++j;
      while (j < f.size() && is_digit(f[j])) ++j;
      prec = f.substr(p0, j - p0);
      if (prec.empty()) prec = "0";
    }
    for (const std::string* n : {&width, &prec}) {  // the output is at least this long
      if (n->size() > 9) raise("format width or precision {} is too big", *n);
      if (!n->empty()) count_bytes(std::stoll(*n));
    }
    if (j >= f.size()) raise("incomplete format");
    char conv = f[j];
    i = j;
    if (conv == '%') {
      out += '%';
      continue;
    }
    if (next >= args.size()) raise("not enough arguments for format string");
    const Value& v = args[next++];
    std::string spec = "{:";
    if (flags.find('-') != std::string::npos)
      spec += '<';
    else if (conv == 's' || conv == 'r')
      spec += '>';
    // Python ignores the sign and zero flags for %s and %r; fmt rejects them for strings.
    const bool numeric = conv != 's' && conv != 'r';
    if (numeric && flags.find('+') != std::string::npos)
      spec += '+';
    else if (numeric && flags.find(' ') != std::string::npos)
      spec += ' ';
    if (numeric && flags.find('0') != std::string::npos && flags.find('-') == std::string::npos)
      spec += '0';
    spec += width;
    if (conv == 's' || conv == 'r') {
      std::string text = conv == 's' ? to_str(v) : (v.data() ? repr(v.j()) : to_str(v));
      if (!prec.empty()) text = to_u8(to_u32(text).substr(0, std::stoul(prec)));
      out += fmt::format(fmt::runtime(spec + "}"), text);
      continue;
    }
    if (!v.data() || !is_num(v.j())) raise("%{} format: a real number is required, not {}", conv, type_name(v));
    try {
      if (std::strchr("dixXo", conv)) {
        std::string t = conv == 'd' || conv == 'i' ? "d" : std::string(1, conv);
        out += fmt::format(fmt::runtime(spec + t + "}"), as_int(v.j()));
      } else if (std::strchr("fFeEgG", conv)) {
        out += fmt::format(fmt::runtime(spec + "." + (prec.empty() ? "6" : prec) + conv + "}"), as_double(v.j()));
      } else {
        raise("unsupported format character '{}'", conv);
      }
    } catch (const fmt::format_error& e) {
      raise("%{} format: {}", conv, e.what());
    }
  }
  if (next < args.size()) raise("not all arguments converted during string formatting");
  return out;
}

Value arith(std::string_view op, const Value& a, const Value& b) {
  if (a.undefined()) raise_undefined(a);
  if (b.undefined()) raise_undefined(b);
  auto bad = [&]() -> Value {
    raise("unsupported operand type(s) for {}: '{}' and '{}'", op, type_name(a), type_name(b));
  };
  if (!a.data() || !b.data()) return bad();
  const Json &x = a.j(), &y = b.j();
  if (op == "%" && x.is_string()) return Value::of(percent_format(a.str(), b));
  if (op == "+") {
    if (x.is_string() && y.is_string()) return Value::of(a.str() + b.str());
    if (x.is_array() && y.is_array()) {
      Json out = x;
      out.insert(out.end(), y.begin(), y.end());
      return Value::of(std::move(out));
    }
  }
  if (op == "*") {
    auto repeat = [&](const Json& seq, const Json& n) -> Value {
      int64_t k = std::max<int64_t>(0, as_int(n));
      const int64_t each = seq.is_string() ? int64_t(seq.get_ref<const std::string&>().size()) : json_cost(seq) - 16;
      count_bytes(cost_of(k, each));
      if (seq.empty() || (seq.is_string() && seq.get_ref<const std::string&>().empty())) k = 0;
      if (seq.is_string()) {
        std::string out;
        for (int64_t i = 0; i < k; ++i) out += seq.get_ref<const std::string&>();
        return Value::of(std::move(out));
      }
      Json out = Json::array();
      for (int64_t i = 0; i < k; ++i) out.insert(out.end(), seq.begin(), seq.end());
      return Value::of(std::move(out));
    };
    if ((x.is_string() || x.is_array()) && is_int(y)) return repeat(x, y);
    if ((y.is_string() || y.is_array()) && is_int(x)) return repeat(y, x);
  }
  if (!is_num(x) || !is_num(y)) return bad();
  if (is_int(x) && is_int(y) && op != "/") {
    int64_t p = as_int(x), q = as_int(y), r = 0;
    bool overflow = false;
    if (op == "+") {
      overflow = __builtin_add_overflow(p, q, &r);
    } else if (op == "-") {
      overflow = __builtin_sub_overflow(p, q, &r);
    } else if (op == "*") {
      overflow = __builtin_mul_overflow(p, q, &r);
    } else if (op == "//" || op == "%") {
      if (q == 0) raise("integer division or modulo by zero");
      if (q == -1) {  // INT64_MIN / -1 overflows
        if (op == "%") r = 0;
        else overflow = __builtin_sub_overflow(int64_t{0}, p, &r);
      } else {
        int64_t d = p / q, m = p % q;
        if (m != 0 && ((m < 0) != (q < 0))) --d, m += q;
        r = op == "//" ? d : m;
      }
    } else if (op == "**") {
      if (q < 0) return Value::of(std::pow(static_cast<double>(p), static_cast<double>(q)));
      // By squaring: a base of 0, 1 or -1 never overflows, so counting up to q could take 2^63 steps.
      r = 1;
      for (int64_t base = p, e = q; e > 0 && !overflow; e >>= 1) {
        if (e & 1) overflow = __builtin_mul_overflow(r, base, &r);
        if (e > 1 && !overflow) overflow = __builtin_mul_overflow(base, base, &base);
      }
    }
    if (overflow) raise("integer overflow in '{}'", op);
    return Value::of(r);
  }
  double p = as_double(x), q = as_double(y);
  if (op == "+") return Value::of(p + q);
  if (op == "-") return Value::of(p - q);
  if (op == "*") return Value::of(p * q);
  if (op == "**") return Value::of(std::pow(p, q));
  if (q == 0) raise("float division by zero");
  if (op == "/") return Value::of(p / q);
  double m = std::fmod(p, q);
  if (m != 0 && ((m < 0) != (q < 0))) m += q;
  if (op == "%") return Value::of(m);
  return Value::of(std::floor((p - m) / q + 0.5));  // "//": exact for the floored quotient
}

bool compare(std::string_view op, const Value& a, const Value& b) {
  if (op == "==") return py_eq(a, b);
  if (op == "!=") return !py_eq(a, b);
  if (op == "in") return contains(b, a);
  if (op == "notin") return !contains(b, a);
  int c = value_cmp(a, b);
  if (op == "<") return c < 0;
  if (op == "<=") return c <= 0;
  if (op == ">") return c > 0;
  return c >= 0;
}

// ---------------------------------------------------------------------------------------------
// Python's json.dumps, which is what transformers' tojson filter calls.

struct DumpOptions {
  bool ensure_ascii = false;
  std::optional<std::string> indent;
  std::string item_sep = ", ", key_sep = ": ";
  bool sort_keys = false;
};

void dump_string(const std::string& s, bool ensure_ascii, std::string& out) {
  out += '"';
  for (size_t i = 0, n; i < s.size(); i += n) {
    char32_t c = decode_at(s, i, &n);
    switch (c) {
      case '"': out += "\\\""; continue;
      case '\\': out += "\\\\"; continue;
      case '\n': out += "\\n"; continue;
      case '\r': out += "\\r"; continue;
      case '\t': out += "\\t"; continue;
      case '\b': out += "\\b"; continue;
      case '\f': out += "\\f"; continue;
      default: break;
    }
    if (c < 0x20 || (ensure_ascii && c > 0x7E)) {
      if (c > 0xFFFF) {
        char32_t v = c - 0x10000;
        out += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
      } else {
        out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
      }
    } else {
      out.append(s, i, n);
    }
  }
  out += '"';
}

void dump_json(const Json& j, const DumpOptions& o, int level, std::string& out) {
  auto newline = [&](int lvl) {
    if (!o.indent) return;
    count_bytes(cost_of(lvl, int64_t(o.indent->size())));
    out += '\n';
    for (int i = 0; i < lvl; ++i) out += *o.indent;
  };
  switch (j.type()) {
    case Json::value_t::null: out += "null"; return;
    case Json::value_t::boolean: out += j.get<bool>() ? "true" : "false"; return;
    case Json::value_t::number_float: {
      double d = j.get<double>();
      out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d < 0 ? "-Infinity" : "Infinity") : py_float(d);
      return;
    }
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned: out += repr(j); return;
    case Json::value_t::string: dump_string(j.get_ref<const std::string&>(), o.ensure_ascii, out); return;
    case Json::value_t::array: {
      if (j.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < j.size(); ++i) {
        if (i) out += o.item_sep;
        newline(level + 1);
        dump_json(j[i], o, level + 1, out);
      }
      newline(level);
      out += ']';
      return;
    }
    case Json::value_t::object: {
      if (j.empty()) {
        out += "{}";
        return;
      }
      std::vector<std::pair<const std::string*, const Json*>> items;
      for (auto it = j.begin(); it != j.end(); ++it) items.emplace_back(&it.key(), &it.value());
      if (o.sort_keys)
        std::stable_sort(items.begin(), items.end(), [](auto& a, auto& b) { return *a.first < *b.first; });
      out += '{';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += o.item_sep;
        newline(level + 1);
        dump_string(*items[i].first, o.ensure_ascii, out);
        out += o.key_sep;
        dump_json(*items[i].second, o, level + 1, out);
      }
      newline(level);
      out += '}';
      return;
    }
    default: raise("Object of type binary is not JSON serializable");
  }
}

// ---------------------------------------------------------------------------------------------
// Builtin call plumbing

// Binds call arguments to a Python-style parameter list, rejecting what Python would reject.
std::vector<std::optional<Value>> bind(const Args& a, std::string_view fn,
                                       std::initializer_list<std::string_view> params) {
  std::vector<std::string_view> names(params);
  if (a.pos.size() > names.size())
    raise("{}() takes at most {} argument(s) ({} given)", fn, names.size(), a.pos.size());
  std::vector<std::optional<Value>> out(names.size());
  for (size_t i = 0; i < a.pos.size(); ++i) out[i] = a.pos[i];
  for (const auto& [k, v] : a.kw) {
    auto it = std::find(names.begin(), names.end(), k);
    if (it == names.end()) raise("{}() got an unexpected keyword argument '{}'", fn, k);
    auto& slot = out[it - names.begin()];
    if (slot) raise("{}() got multiple values for argument '{}'", fn, k);
    slot = v;
  }
  return out;
}

std::string opt_str(const std::optional<Value>& v, std::string dflt) { return v ? to_str(*v) : dflt; }
bool opt_bool(const std::optional<Value>& v, bool dflt) { return v ? truthy(*v) : dflt; }
int64_t opt_int(const std::optional<Value>& v, int64_t dflt, std::string_view what) {
  if (!v || (v->data() && v->j().is_null())) return dflt;
  if (!v->data() || !is_int(v->j())) raise("{} must be an integer, not {}", what, type_name(*v));
  return as_int(v->j());
}

std::vector<std::string> py_split(const std::string& s, const std::optional<std::string>& sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (!sep) {
    size_t i = skip_space(s, 0);
    while (i < s.size()) {
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        out.push_back(s.substr(i));
        return out;
      }
      size_t j = i, n;
      while (j < s.size() && !py_space(decode_at(s, j, &n))) j += n;
      out.push_back(s.substr(i, j - i));
      i = skip_space(s, j);
    }
    return out;
  }
  if (sep->empty()) raise("empty separator");
  count_steps(cost_of(int64_t(s.size()), int64_t(sep->size()) / 64 + 1) / 8);
  size_t i = 0;
  while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
    size_t j = s.find(*sep, i);
    if (j == std::string::npos) break;
    out.push_back(s.substr(i, j - i));
    i = j + sep->size();
  }
  out.push_back(s.substr(i));
  return out;
}

std::string py_replace(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  count_steps(cost_of(int64_t(s.size()), int64_t(from.size()) / 64 + 1) / 8);
  std::string out;
  if (from.empty()) {
    std::u32string u = to_u32(s);
    int64_t done = 0;
    for (char32_t c : u) {
      if (count < 0 || done < count) count_bytes(int64_t(to.size())), out += to, ++done;
      utf8_append(out, c);
    }
    if (count < 0 || done < count) out += to;
    return out;
  }
  size_t i = 0;
  for (int64_t done = 0; count < 0 || done < count; ++done) {
    size_t j = s.find(from, i);
    if (j == std::string::npos) break;
    out.append(s, i, j - i);
    count_bytes(int64_t(to.size()));
    out += to;
    i = j + from.size();
  }
  out.append(s, i, std::string::npos);
  return out;
}

std::string py_capitalize(const std::string& s) {
  std::string out = ascii_lower(s);
  if (!out.empty()) out[0] = ascii_upper(out.substr(0, 1))[0];
  return out;
}

std::string py_title(const std::string& s) {  // str.title(): a letter after a non-letter is upper
  std::string out = s;
  bool prev_cased = false;
  for (char& c : out) {
    bool alpha = is_alpha(c);
    if (alpha) c = prev_cased ? ascii_lower(std::string(1, c))[0] : ascii_upper(std::string(1, c))[0];
    prev_cased = alpha;
  }
  return out;
}

// Python's find() returns a code point index.
int64_t cp_index(const std::string& s, size_t byte_pos) {
  return is_ascii(s) ? byte_pos : to_u32(std::string_view(s).substr(0, byte_pos)).size();
}

Value call_method(const Value& self, const std::string& name, const Args& a) {
  const Json& j = self.j();
  if (j.is_object()) {
    if (name == "get") {
      auto p = bind(a, "get", {"key", "default"});
      if (!p[0]) raise("get expected at least 1 argument, got 0");
      if (p[0]->is_str()) {
        auto it = j.find(p[0]->str());
        if (it != j.end()) return self.child(*it);
      }
      return p[1] ? *p[1] : none_value();
    }
    bind(a, name, {});
    Json out = Json::array();
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (name == "items") out.push_back(Json::array({it.key(), it.value()}));
      if (name == "keys") out.push_back(it.key());
      if (name == "values") out.push_back(it.value());
    }
    return Value::of(std::move(out));
  }
  const std::string& s = self.str();
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    auto p = bind(a, name, {"chars"});
    int side = name == "strip" ? kBoth : name == "lstrip" ? kLeft : kRight;
    if (!p[0] || !p[0]->data() || p[0]->j().is_null()) return Value::of(py_strip(s, side));
    if (!p[0]->is_str()) raise("{} arg must be None or str", name);
    std::u32string chars = to_u32(p[0]->str());
    return Value::of(py_strip(s, side, &chars));
  }
  if (name == "split") {
    auto p = bind(a, name, {"sep", "maxsplit"});
    std::optional<std::string> sep;
    if (p[0] && !(p[0]->data() && p[0]->j().is_null())) {
      if (!p[0]->is_str()) raise("must be str or None, not {}", type_name(*p[0]));
      sep = p[0]->str();
    }
    Json out = Json::array();
    for (auto& part : py_split(s, sep, opt_int(p[1], -1, "maxsplit"))) out.push_back(std::move(part));
    return Value::of(std::move(out));
  }
  if (name == "startswith" || name == "endswith") {
    auto p = bind(a, name, {"prefix", "start", "end"});
    if (!p[0]) raise("{}() takes at least 1 argument (0 given)", name);
    std::u32string u = to_u32(s);
    int64_t n = u.size();
    auto clampi = [&](int64_t x) { return std::clamp(x < 0 ? x + n : x, int64_t{0}, n); };
    int64_t b = clampi(opt_int(p[1], 0, "start")), e = clampi(opt_int(p[2], n, "end"));
    std::u32string window = b <= e ? u.substr(b, e - b) : std::u32string();
    std::vector<Value> cands = p[0]->data() && p[0]->j().is_array() ? iterate(*p[0]) : std::vector<Value>{*p[0]};
    for (const Value& c : cands) {
      if (!c.is_str()) raise("{} first arg must be str or a tuple of str", name);
      std::u32string x = to_u32(c.str());
      if (x.size() > window.size() || b > e) continue;
      bool hit = name == "startswith" ? window.compare(0, x.size(), x) == 0
                                      : window.compare(window.size() - x.size(), x.size(), x) == 0;
      if (hit) return bool_value(true);
    }
    return bool_value(false);
  }
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
    bind(a, name, {});
    if (name == "upper") return Value::of(ascii_upper(s));
    if (name == "lower") return Value::of(ascii_lower(s));
    return Value::of(name == "title" ? py_title(s) : py_capitalize(s));
  }
  if (name == "replace") {
    auto p = bind(a, name, {"old", "new", "count"});
    if (!p[0] || !p[1] || !p[0]->is_str() || !p[1]->is_str()) raise("replace() arguments must be str");
    return Value::of(py_replace(s, p[0]->str(), p[1]->str(), opt_int(p[2], -1, "count")));
  }
  if (name == "find" || name == "count") {
    auto p = bind(a, name, {"sub"});
    if (!p[0] || !p[0]->is_str()) raise("{}() argument must be str", name);
    const std::string& sub = p[0]->str();
    count_steps(cost_of(int64_t(s.size()), int64_t(sub.size()) / 64 + 1) / 8);
    if (name == "find") {
      size_t pos = s.find(sub);
      return Value::of(pos == std::string::npos ? int64_t{-1} : cp_index(s, pos));
    }
    if (sub.empty()) return Value::of(static_cast<int64_t>(to_u32(s).size() + 1));
    int64_t k = 0;
    for (size_t pos = s.find(sub); pos != std::string::npos; pos = s.find(sub, pos + sub.size())) ++k;
    return Value::of(k);
  }
  if (name == "join") {
    auto p = bind(a, name, {"iterable"});
    if (!p[0]) raise("join() takes exactly one argument (0 given)");
    std::string out;
    bool first = true;
    for (const Value& v : iterate(*p[0])) {
      if (!v.is_str()) raise("sequence item: expected str instance, {} found", type_name(v));
      count_bytes(int64_t(s.size() + v.str().size()));
      if (!first) out += s;
      out += v.str();
      first = false;
    }
    return Value::of(std::move(out));
  }
  // is*(): ASCII classification, true only for non-empty strings as in Python.
  bind(a, name, {});
  auto all = [&](auto pred) { return bool_value(!s.empty() && std::all_of(s.begin(), s.end(), pred)); };
  if (name == "isdigit") return all([](char c) { return is_digit(c); });
  if (name == "isalpha") return all([](char c) { return is_alpha(c); });
  if (name == "isalnum") return all([](char c) { return is_alpha(c) || is_digit(c); });
  if (name == "isspace") return all([](char c) { return py_space(static_cast<unsigned char>(c)); });
  bool any_cased = std::any_of(s.begin(), s.end(), [](char c) { return is_alpha(c); });
  if (name == "islower") return bool_value(any_cased && ascii_lower(s) == s);
  return bool_value(any_cased && ascii_upper(s) == s);  // isupper
}

// ---------------------------------------------------------------------------------------------
// Filters and tests (jinja2/filters.py, tests.py)

using FilterFn = Value (*)(const Value&, const Args&);
using TestFn = bool (*)(const Value&, const Args&);
const std::unordered_map<std::string_view, FilterFn>& filter_table();
const std::unordered_map<std::string_view, TestFn>& test_table();

Value apply_filter(const std::string& name, const Value& v, const Args& a) {
  auto it = filter_table().find(name);
  if (it == filter_table().end()) raise("unsupported filter '{}'", name);
  return it->second(v, a);
}

bool apply_test(const std::string& name, const Value& v, const Args& a) {
  auto it = test_table().find(name);
  if (it == test_table().end()) raise("unsupported test '{}'", name);
  return it->second(v, a);
}

// make_attrgetter: "a.b.0" looks up item by item, digit parts as list indices.
Value attr_path(const Value& item, const std::string& path) {
  Value cur = item;
  size_t i = 0;
  while (true) {
    size_t dot = path.find('.', i);
    std::string part = path.substr(i, dot == std::string::npos ? std::string::npos : dot - i);
    bool digits = !part.empty() && std::all_of(part.begin(), part.end(), is_digit);
    int64_t index = 0;
    if (digits && std::from_chars(part.data(), part.data() + part.size(), index).ec != std::errc())
      raise("index {} is out of range", part);
    cur = get_item(cur, digits ? Value::of(index) : Value::of(part));
    if (dot == std::string::npos) return cur;
    i = dot + 1;
  }
}

// Sort key for sort/dictsort/unique/min/max: case-insensitive unless asked otherwise.
Value fold_case(const Value& v, bool case_sensitive) {
  return !case_sensitive && v.is_str() ? Value::of(ascii_lower(v.str())) : v;
}

Value sort_filter(const Value& v, const Args& a) {
  auto p = bind(a, "sort", {"reverse", "case_sensitive", "attribute"});
  bool reverse = opt_bool(p[0], false), cs = opt_bool(p[1], false);
  std::vector<Value> items = iterate(v);
  std::vector<std::pair<Value, Value>> keyed;
  for (auto& it : items) keyed.emplace_back(fold_case(p[2] ? attr_path(it, to_str(*p[2])) : it, cs), it);
  std::stable_sort(keyed.begin(), keyed.end(), [&](auto& x, auto& y) {
    return reverse ? value_cmp(y.first, x.first) < 0 : value_cmp(x.first, y.first) < 0;
  });
  std::vector<Value> out;
  for (auto& k : keyed) out.push_back(k.second);
  return list_value(out);
}

Value minmax(const Value& v, const Args& a, bool want_max) {
  auto p = bind(a, want_max ? "max" : "min", {"case_sensitive", "attribute"});
  bool cs = opt_bool(p[0], false);
  std::optional<Value> best, best_key;
  for (const Value& it : iterate(v)) {
    Value k = fold_case(p[1] ? attr_path(it, to_str(*p[1])) : it, cs);
    if (!best || (want_max ? value_cmp(k, *best_key) > 0 : value_cmp(k, *best_key) < 0)) best = it, best_key = k;
  }
  return best ? *best : Value::undef("No aggregated item, sequence was empty.");
}

Value select_filter(const Value& v, const Args& a, bool by_attr, bool keep) {
  if (by_attr && a.pos.empty()) raise("selectattr/rejectattr need an attribute name");
  size_t first = by_attr ? 1 : 0;
  Args test_args;
  test_args.pos.assign(a.pos.begin() + std::min(a.pos.size(), first + 1), a.pos.end());
  test_args.kw = a.kw;
  std::optional<std::string> test;
  if (a.pos.size() > first) test = to_str(a.pos[first]);
  std::vector<Value> out;
  for (const Value& it : iterate(v)) {
    Value subject = by_attr ? attr_path(it, to_str(a.pos[0])) : it;
    bool ok = test ? apply_test(*test, subject, test_args) : truthy(subject);
    if (ok == keep) out.push_back(it);
  }
  return list_value(out);
}

Value map_filter(const Value& v, const Args& a) {
  std::vector<Value> out;
  auto attr = std::find_if(a.kw.begin(), a.kw.end(), [](auto& kv) { return kv.first == "attribute"; });
  if (attr != a.kw.end()) {
    auto dflt = std::find_if(a.kw.begin(), a.kw.end(), [](auto& kv) { return kv.first == "default"; });
    for (const Value& it : iterate(v)) {
      Value x = attr_path(it, to_str(attr->second));
      out.push_back(x.undefined() && dflt != a.kw.end() ? dflt->second : x);
    }
    return list_value(out);
  }
  if (a.pos.empty()) raise("map requires a filter name or attribute=");
  std::string name = to_str(a.pos[0]);
  Args rest{std::vector<Value>(a.pos.begin() + 1, a.pos.end()), a.kw};
  for (const Value& it : iterate(v)) out.push_back(apply_filter(name, it, rest));
  return list_value(out);
}

Value dictsort_filter(const Value& v, const Args& a) {
  auto p = bind(a, "dictsort", {"case_sensitive", "by", "reverse"});
  if (v.undefined()) raise_undefined(v);
  if (!v.data() || !v.j().is_object()) raise("dictsort requires a mapping, not {}", type_name(v));
  bool cs = opt_bool(p[0], false), reverse = opt_bool(p[2], false);
  std::string by = opt_str(p[1], "key");
  if (by != "key" && by != "value") raise("You can only sort by either \"key\" or \"value\"");
  std::vector<std::pair<Value, Json>> rows;
  for (auto it = v.j().begin(); it != v.j().end(); ++it) {
    Value key = by == "key" ? Value::of(it.key()) : v.child(it.value());
    rows.emplace_back(fold_case(key, cs), Json::array({it.key(), it.value()}));
  }
  std::stable_sort(rows.begin(), rows.end(), [&](auto& x, auto& y) {
    return reverse ? value_cmp(y.first, x.first) < 0 : value_cmp(x.first, y.first) < 0;
  });
  Json out = Json::array();
  for (auto& r : rows) out.push_back(std::move(r.second));
  return Value::of(std::move(out));
}

Value tojson_filter(const Value& v, const Args& a) {
  auto p = bind(a, "tojson", {"ensure_ascii", "indent", "separators", "sort_keys"});
  DumpOptions o;
  o.ensure_ascii = opt_bool(p[0], false);
  o.sort_keys = opt_bool(p[3], false);
  if (p[1] && !(p[1]->data() && p[1]->j().is_null())) {
    const int64_t width = p[1]->is_str() ? 0 : std::max<int64_t>(0, opt_int(p[1], 0, "indent"));
    count_bytes(width);
    o.indent = p[1]->is_str() ? p[1]->str() : std::string(width, ' ');
    o.item_sep = ",";
  }
  if (p[2] && !(p[2]->data() && p[2]->j().is_null())) {
    std::vector<Value> seps = iterate(*p[2]);
    if (seps.size() != 2) raise("separators must be an (item_separator, key_separator) pair");
    o.item_sep = to_str(seps[0]);
    o.key_sep = to_str(seps[1]);
  }
  if (!v.data()) raise("Object of type {} is not JSON serializable", type_name(v));
  std::string out;
  dump_json(v.j(), o, 0, out);
  return Value::of(std::move(out));
}

Value int_filter(const Value& v, const Args& a) {
  auto p = bind(a, "int", {"default", "base"});
  Value dflt = p[0] ? *p[0] : Value::of(0);
  if (v.undefined()) raise_undefined(v);
  if (!v.data()) return dflt;
  const Json& j = v.j();
  if (is_int(j)) return Value::of(as_int(j));
  if (j.is_number_float()) return std::isfinite(j.get<double>()) ? Value::of(as_int(j)) : dflt;
  if (!j.is_string()) return dflt;
  std::string s = py_strip(v.str(), kBoth);
  s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
  int base = static_cast<int>(opt_int(p[1], 10, "base"));
  int64_t r = 0;
  const char* b = s.data() + (!s.empty() && s[0] == '+' ? 1 : 0);
  auto res = std::from_chars(b, s.data() + s.size(), r, base);
  if (!s.empty() && res.ec == std::errc() && res.ptr == s.data() + s.size()) return Value::of(r);
  char* end = nullptr;
  double d = std::strtod(s.c_str(), &end);
  if (!s.empty() && end == s.c_str() + s.size() && std::isfinite(d)) return Value::of(as_int(Json(d)));
  return dflt;
}

Value float_filter(const Value& v, const Args& a) {
  auto p = bind(a, "float", {"default"});
  Value dflt = p[0] ? *p[0] : Value::of(0.0);
  if (v.undefined()) raise_undefined(v);
  if (!v.data()) return dflt;
  if (is_num(v.j())) return Value::of(as_double(v.j()));
  if (!v.j().is_string()) return dflt;
  std::string s = py_strip(v.str(), kBoth);
  char* end = nullptr;
  double d = std::strtod(s.c_str(), &end);
  return !s.empty() && end == s.c_str() + s.size() ? Value::of(d) : dflt;
}

Value round_filter(const Value& v, const Args& a) {
  auto p = bind(a, "round", {"precision", "method"});
  int64_t prec = opt_int(p[0], 0, "precision");
  std::string method = opt_str(p[1], "common");
  if (v.undefined()) raise_undefined(v);
  if (!v.data() || !is_num(v.j())) raise("round() needs a number, not {}", type_name(v));
  double scale = std::pow(10.0, static_cast<double>(prec)), x = as_double(v.j()) * scale;
  if (method == "ceil") return Value::of(std::ceil(x) / scale);
  if (method == "floor") return Value::of(std::floor(x) / scale);
  if (method != "common") raise("method must be 'common', 'ceil' or 'floor'");
  if (is_int(v.j())) return Value::of(as_int(v.j()));  // round(int, n) stays int
  return Value::of(std::nearbyint(x) / scale);         // half-to-even, as Python's round()
}

Value indent_filter(const Value& v, const Args& a) {
  auto p = bind(a, "indent", {"width", "first", "blank"});
  const int64_t width = p[0] && p[0]->is_str() ? 0 : std::max<int64_t>(0, opt_int(p[0], 4, "width"));
  count_bytes(width);
  std::string ind = p[0] && p[0]->is_str() ? p[0]->str() : std::string(width, ' ');
  bool first = opt_bool(p[1], false), blank = opt_bool(p[2], false);
  std::vector<std::string> lines = py_split(to_str(v) + "\n", std::string("\n"), -1);
  lines.pop_back();  // the appended "\n" mirrors jinja's splitlines() quirk
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i) out += "\n";
    if (i && (blank || !lines[i].empty())) count_bytes(int64_t(ind.size())), out += ind;
    out += lines[i];
  }
  return Value::of(first ? ind + out : out);
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// jinja's title filter splits on runs of "-", whitespace and opening brackets.
std::string title_filter(const std::string& s) {
  std::string out;
  bool at_start = true;
  for (char c : s) {
    bool sep = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || py_space(static_cast<unsigned char>(c));
    if (sep) {
      out += c;
      at_start = true;
    } else {
      out += at_start ? ascii_upper(std::string(1, c)) : ascii_lower(std::string(1, c));
      at_start = false;
    }
  }
  return out;
}

Value string_fn(std::string (*f)(std::string), const Value& v) { return Value::of(f(to_str(v))); }

const std::unordered_map<std::string_view, FilterFn>& filter_table() {
  static const std::unordered_map<std::string_view, FilterFn> table = {
      {"abs",
       [](const Value& v, const Args& a) {
         bind(a, "abs", {});
         if (v.undefined()) raise_undefined(v);
         if (!v.data() || !is_num(v.j())) raise("bad operand type for abs(): '{}'", type_name(v));
         if (!is_int(v.j())) return Value::of(std::fabs(as_double(v.j())));
         int64_t x = as_int(v.j());
         if (x == INT64_MIN) raise("integer overflow in abs()");
         return Value::of(std::abs(x));
       }},
      {"attr",
       [](const Value& v, const Args& a) {
         auto p = bind(a, "attr", {"name"});
         return get_attr(v, opt_str(p[0], ""));
       }},
      {"capitalize",
       [](const Value& v, const Args& a) {
         bind(a, "capitalize", {});
         return Value::of(py_capitalize(to_str(v)));
       }},
      {"count",
       [](const Value& v, const Args& a) {
         bind(a, "count", {});
         return Value::of(py_len(v));
       }},
      {"default",
       [](const Value& v, const Args& a) {
         auto p = bind(a, "default", {"default_value", "boolean"});
         bool use = v.undefined() || (opt_bool(p[1], false) && !truthy(v));
         return use ? (p[0] ? *p[0] : Value::of("")) : v;
       }},
      {"dictsort", dictsort_filter},
      {"escape",
       [](const Value& v, const Args& a) {
         bind(a, "escape", {});
         return Value::of(html_escape(to_str(v)));
       }},
      {"first",
       [](const Value& v, const Args& a) {
         bind(a, "first", {});
         auto items = iterate(v);
         return items.empty() ? Value::undef("No first item, sequence was empty.") : items.front();
       }},
      {"float", float_filter},
      {"indent", indent_filter},
      {"int", int_filter},
      {"items",
       [](const Value& v, const Args& a) {
         bind(a, "items", {});
         if (v.undefined()) return Value::of(Json::array());
         if (!v.data() || !v.j().is_object()) raise("Can only get item pairs from a mapping.");
         return call_method(v, "items", Args{});
       }},
      {"join",
       [](const Value& v, const Args& a) {
         auto p = bind(a, "join", {"d", "attribute"});
         std::string sep = opt_str(p[0], ""), out;
         bool first = true;
         for (const Value& it : iterate(v)) {
           std::string piece = to_str(p[1] ? attr_path(it, to_str(*p[1])) : it);
           count_bytes(int64_t(sep.size() + piece.size()));
           if (!first) out += sep;
           out += piece;
           first = false;
         }
         return Value::of(std::move(out));
       }},
      {"last",
       [](const Value& v, const Args& a) {
         bind(a, "last", {});
         auto items = iterate(v);
         return items.empty() ? Value::undef("No last item, sequence was empty.") : items.back();
       }},
      {"length",
       [](const Value& v, const Args& a) {
         bind(a, "length", {});
         return Value::of(py_len(v));
       }},
      {"list",
       [](const Value& v, const Args& a) {
         bind(a, "list", {});
         return list_value(iterate(v));
       }},
      {"lower",
       [](const Value& v, const Args& a) {
         bind(a, "lower", {});
         return string_fn(ascii_lower, v);
       }},
      {"map", map_filter},
      {"max", [](const Value& v, const Args& a) { return minmax(v, a, true); }},
      {"min", [](const Value& v, const Args& a) { return minmax(v, a, false); }},
      {"reject", [](const Value& v, const Args& a) { return select_filter(v, a, false, false); }},
      {"rejectattr", [](const Value& v, const Args& a) { return select_filter(v, a, true, false); }},
      {"replace",
       [](const Value& v, const Args& a) {
         auto p = bind(a, "replace", {"old", "new", "count"});
         if (!p[0] || !p[1]) raise("replace() needs old and new");
         return Value::of(py_replace(to_str(v), to_str(*p[0]), to_str(*p[1]), opt_int(p[2], -1, "count")));
       }},
      {"reverse",
       [](const Value& v, const Args& a) {
         bind(a, "reverse", {});
         if (v.is_str()) {
           std::u32string u = to_u32(v.str());
           return Value::of(to_u8(std::u32string(u.rbegin(), u.rend())));
         }
         auto items = iterate(v);
         std::reverse(items.begin(), items.end());
         return list_value(items);
       }},
      {"round", round_filter},
      {"safe",
       [](const Value& v, const Args& a) {
         bind(a, "safe", {});
         return Value::of(to_str(v));
       }},
      {"select", [](const Value& v, const Args& a) { return select_filter(v, a, false, true); }},
      {"selectattr", [](const Value& v, const Args& a) { return select_filter(v, a, true, true); }},
      {"sort", sort_filter},
      {"string",
       [](const Value& v, const Args& a) {
         bind(a, "string", {});
         return Value::of(to_str(v));
       }},
      {"sum",
       [](const Value& v, const Args& a) {
         auto p = bind(a, "sum", {"attribute", "start"});
         Value acc = p[1] ? *p[1] : Value::of(0);
         for (const Value& it : iterate(v)) acc = arith("+", acc, p[0] ? attr_path(it, to_str(*p[0])) : it);
         return acc;
       }},
      {"title",
       [](const Value& v, const Args& a) {
         bind(a, "title", {});
         return Value::of(title_filter(to_str(v)));
       }},
      {"tojson", tojson_filter},
      {"trim",
       [](const Value& v, const Args& a) {
         auto p = bind(a, "trim", {"chars"});
         if (!p[0] || (p[0]->data() && p[0]->j().is_null())) return Value::of(py_strip(to_str(v), kBoth));
         std::u32string chars = to_u32(to_str(*p[0]));
         return Value::of(py_strip(to_str(v), kBoth, &chars));
       }},
      {"unique",
       [](const Value& v, const Args& a) {
         auto p = bind(a, "unique", {"case_sensitive", "attribute"});
         std::vector<Value> out, seen;
         for (const Value& it : iterate(v)) {
           Value k = fold_case(p[1] ? attr_path(it, to_str(*p[1])) : it, opt_bool(p[0], false));
           count_steps(int64_t(seen.size()));
           if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return py_eq(s, k); }))
             seen.push_back(k), out.push_back(it);
         }
         return list_value(out);
       }},
      {"upper",
       [](const Value& v, const Args& a) {
         bind(a, "upper", {});
         return string_fn(ascii_upper, v);
       }},
  };
  static const auto with_aliases = [] {
    auto t = table;
    t["d"] = t["default"];
    t["e"] = t["escape"];
    t["forceescape"] = t["escape"];
    return t;
  }();
  return with_aliases;
}

bool num_test(const Value& v, bool (*pred)(const Json&)) { return v.data() && pred(v.j()); }

bool cmp_test(const Value& v, const Args& a, std::string_view op) {
  if (a.pos.size() != 1 || !a.kw.empty()) raise("test '{}' takes exactly one argument", op);
  return compare(op, v, a.pos[0]);
}

int64_t int_of(const Value& v, std::string_view test) {
  if (v.undefined()) raise_undefined(v);
  if (!v.data() || !is_num(v.j())) raise("test '{}' needs a number, not {}", test, type_name(v));
  return as_int(v.j());
}

const std::unordered_map<std::string_view, TestFn>& test_table() {
  static const std::unordered_map<std::string_view, TestFn> table = {
      {"boolean",
       [](const Value& v, const Args&) { return num_test(v, [](const Json& j) { return j.is_boolean(); }); }},
      {"callable", [](const Value& v, const Args&) { return v.kind == Value::Kind::Callable; }},
      {"defined", [](const Value& v, const Args&) { return !v.undefined(); }},
      {"divisibleby",
       [](const Value& v, const Args& a) {
         if (a.pos.size() != 1) raise("divisibleby takes one argument");
         int64_t d = int_of(a.pos[0], "divisibleby");
         if (d == 0) raise("integer division or modulo by zero");
         return int_of(v, "divisibleby") % d == 0;
       }},
      {"eq", [](const Value& v, const Args& a) { return cmp_test(v, a, "=="); }},
      {"escaped", [](const Value&, const Args&) { return false; }},
      {"even", [](const Value& v, const Args&) { return int_of(v, "even") % 2 == 0; }},
      {"false", [](const Value& v, const Args&) { return v.data() && v.j().is_boolean() && !v.j().get<bool>(); }},
      {"filter", [](const Value& v, const Args&) { return v.is_str() && filter_table().count(v.str()) > 0; }},
      {"float",
       [](const Value& v, const Args&) { return num_test(v, [](const Json& j) { return j.is_number_float(); }); }},
      {"ge", [](const Value& v, const Args& a) { return cmp_test(v, a, ">="); }},
      {"gt", [](const Value& v, const Args& a) { return cmp_test(v, a, ">"); }},
      {"in", [](const Value& v, const Args& a) { return cmp_test(v, a, "in"); }},
      {"integer",
       [](const Value& v, const Args&) { return num_test(v, [](const Json& j) { return j.is_number_integer(); }); }},
      {"iterable",
       [](const Value& v, const Args&) {
         return v.undefined() || v.kind == Value::Kind::Loop ||
                (v.data() && (v.j().is_string() || v.j().is_array() || v.j().is_object()));
       }},
      {"le", [](const Value& v, const Args& a) { return cmp_test(v, a, "<="); }},
      {"lower",
       [](const Value& v, const Args&) {
         std::string s = to_str(v);
         return std::any_of(s.begin(), s.end(), is_alpha) && ascii_lower(s) == s;
       }},
      {"lt", [](const Value& v, const Args& a) { return cmp_test(v, a, "<"); }},
      {"mapping", [](const Value& v, const Args&) { return v.data() && v.j().is_object(); }},
      {"ne", [](const Value& v, const Args& a) { return cmp_test(v, a, "!="); }},
      {"none", [](const Value& v, const Args&) { return v.data() && v.j().is_null(); }},
      {"number", [](const Value& v, const Args&) { return num_test(v, is_num); }},
      {"odd", [](const Value& v, const Args&) { return int_of(v, "odd") % 2 != 0; }},
      {"sameas",
       [](const Value& v, const Args& a) {
         if (a.pos.size() != 1) raise("sameas takes one argument");
         const Value& o = a.pos[0];
         if (v.data() && o.data()) {  // None/True/False are singletons; anything else by identity
           const Json &x = v.j(), &y = o.j();
           if ((x.is_null() || x.is_boolean()) && x.type() == y.type()) return x == y;
           return v.node == o.node;
         }
         return v.kind == o.kind && !v.data() && py_eq(v, o);
       }},
      {"sequence",
       [](const Value& v, const Args&) {
         return v.undefined() || (v.data() && (v.j().is_string() || v.j().is_array() || v.j().is_object()));
       }},
      {"string", [](const Value& v, const Args&) { return v.is_str(); }},
      {"test", [](const Value& v, const Args&) { return v.is_str() && test_table().count(v.str()) > 0; }},
      {"true", [](const Value& v, const Args&) { return v.data() && v.j().is_boolean() && v.j().get<bool>(); }},
      {"undefined", [](const Value& v, const Args&) { return v.undefined(); }},
      {"upper",
       [](const Value& v, const Args&) {
         std::string s = to_str(v);
         return std::any_of(s.begin(), s.end(), is_alpha) && ascii_upper(s) == s;
       }},
  };
  static const auto with_aliases = [] {
    auto t = table;
    for (auto [alias, name] : {std::pair{"equalto", "eq"},
                               {"==", "eq"},
                               {"!=", "ne"},
                               {"lessthan", "lt"},
                               {"<", "lt"},
                               {"<=", "le"},
                               {"greaterthan", "gt"},
                               {">", "gt"},
                               {">=", "ge"}})
      t[alias] = t[name];
    return t;
  }();
  return with_aliases;
}

// ---------------------------------------------------------------------------------------------
// Lexer (jinja2/lexer.py with trim_blocks=True, lstrip_blocks=True)

enum class Tok { Data, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, Eof };

struct Token {
  Tok type;
  std::string text;
  int line;
};

[[noreturn]] void syntax_error(int line, const std::string& msg) {
  throw Error(fmt::format("chat template line {}: {}", line, msg));
}

// Python's unicode-escape decoding of a string literal body.
std::string unescape(std::string_view s, int line) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 == s.size()) {
      out += s[i];
      continue;
    }
    char c = s[++i];
    auto hex = [&](size_t n) {
      if (i + n >= s.size()) syntax_error(line, "truncated escape in string");
      uint32_t v = 0;
      for (size_t k = 1; k <= n; ++k) {
        char h = s[i + k];
        int d = is_digit(h)              ? h - '0'
                : (h >= 'a' && h <= 'f') ? h - 'a' + 10
                : (h >= 'A' && h <= 'F') ? h - 'A' + 10
                                         : -1;
        if (d < 0) syntax_error(line, "truncated escape in string");
        v = v * 16 + d;
      }
      i += n;
      utf8_append(out, v);
    };
    switch (c) {
      case '\n': break;
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case 'a': out += '\a'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case 'v': out += '\v'; break;
      case 'x': hex(2); break;
      case 'u': hex(4); break;
      case 'U': hex(8); break;
      case 'N': syntax_error(line, "\\N{...} escapes are not supported");
      default:
        if (c >= '0' && c <= '7') {
          uint32_t v = 0;
          size_t k = 0;
          for (; k < 3 && i + k < s.size() && s[i + k] >= '0' && s[i + k] <= '7'; ++k) v = v * 8 + (s[i + k] - '0');
          i += k - 1;
          utf8_append(out, v);
        } else {
          out += '\\';
          out += c;
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(const std::string& source) {
    // jinja normalises newlines and drops a single trailing one (keep_trailing_newline=False).
    s_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        s_ += '\n';
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        s_ += source[i];
      }
    }
    if (!s_.empty() && s_.back() == '\n') s_.pop_back();
  }

  std::vector<Token> run() {
    while (pos_ < s_.size()) {
      size_t tag = pos_;
      while (tag + 1 < s_.size() &&
             !(s_[tag] == '{' && (s_[tag + 1] == '{' || s_[tag + 1] == '%' || s_[tag + 1] == '#')))
        ++tag;
      if (tag + 1 >= s_.size()) {
        data(s_.substr(pos_));
        break;
      }
      char kind = s_[tag + 1];
      char sign = tag + 2 < s_.size() && (s_[tag + 2] == '-' || s_[tag + 2] == '+') ? s_[tag + 2] : 0;
      std::string text = s_.substr(pos_, tag - pos_);
      int text_lines = std::count(text.begin(), text.end(), '\n');
      data(lstrip(std::move(text), sign, kind != '{'));
      line_ += text_lines;
      pos_ = tag + 2 + (sign ? 1 : 0);
      if (kind == '#') {
        comment();
      } else if (kind == '%' && raw()) {
      } else {
        tag_contents(kind == '%');
      }
    }
    out_.push_back({Tok::Eof, "", line_});
    return std::move(out_);
  }

 private:
  void data(std::string text) {
    if (!text.empty()) out_.push_back({Tok::Data, std::move(text), line_});
  }

  // Whitespace control before a tag: "-" strips all of it, otherwise lstrip_blocks removes
  // indentation before block/comment tags that start a line.
  std::string lstrip(std::string text, char sign, bool lstrip_applies) const {
    if (sign == '-') {
      text.resize(rstrip_len(text));
    } else if (sign != '+' && lstrip_applies) {
      size_t nl = text.rfind('\n');
      size_t l = nl == std::string::npos ? 0 : nl + 1;
      if ((l > 0 || line_starting_) && l < text.size() && skip_space(text, l) == text.size()) text.resize(l);
    }
    return text;
  }

  bool at(std::string_view lit) const { return s_.compare(pos_, lit.size(), lit) == 0; }

  // Consumes a tag end: "+END" keeps what follows, "-END" eats all whitespace after it, a plain
  // block/comment end eats one newline (trim_blocks).
  bool tag_end(std::string_view end, bool trim_newline) {
    size_t start = pos_;
    if (trim_newline && s_.compare(pos_, 1, "+") == 0 && s_.compare(pos_ + 1, end.size(), end) == 0) {
      pos_ += 1 + end.size();
    } else if (s_.compare(pos_, 1, "-") == 0 && s_.compare(pos_ + 1, end.size(), end) == 0) {
      pos_ += 1 + end.size();
      size_t after = skip_space(s_, pos_);
      line_ += std::count(s_.begin() + pos_, s_.begin() + after, '\n');
      pos_ = after;
    } else if (at(end)) {
      pos_ += end.size();
      if (trim_newline && pos_ < s_.size() && s_[pos_] == '\n') ++pos_, ++line_;
    } else {
      return false;
    }
    line_starting_ = s_[pos_ - 1] == '\n' && pos_ > start;
    return true;
  }

  void comment() {
    int start_line = line_;
    while (pos_ < s_.size()) {
      if (tag_end("#}", true)) return;
      if (s_[pos_++] == '\n') ++line_;
    }
    syntax_error(start_line, "missing end of comment tag");
  }

  // {% raw %}...{% endraw %}: the body is data, untouched.
  bool raw() {
    size_t save = pos_;
    size_t p = skip_space(s_, pos_);
    if (s_.compare(p, 3, "raw") != 0) return false;
    pos_ = skip_space(s_, p + 3);
    if (!tag_end("%}", false)) {
      pos_ = save;
      return false;
    }
    int start_line = line_;
    for (size_t q = s_.find("{%", pos_); q != std::string::npos; q = s_.find("{%", q + 1)) {
      size_t r = q + 2;
      char sign = r < s_.size() && (s_[r] == '-' || s_[r] == '+') ? s_[r++] : 0;
      r = skip_space(s_, r);
      if (s_.compare(r, 6, "endraw") != 0) continue;
      size_t body_end = q;
      std::string body = s_.substr(pos_, body_end - pos_);
      int body_lines = std::count(body.begin(), body.end(), '\n');
      pos_ = skip_space(s_, r + 6);
      data(lstrip(std::move(body), sign, true));
      line_ += body_lines;
      if (!tag_end("%}", true)) syntax_error(line_, "expected '%}' after endraw");
      return true;
    }
    syntax_error(start_line, "missing end of raw directive");
  }

  void tag_contents(bool block) {
    out_.push_back({block ? Tok::BlockBegin : Tok::VarBegin, "", line_});
    int start_line = line_;
    std::string open;  // closers of the brackets still open; tag ends only count outside them
    static const char* ops[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~", "[",
                                "]",  "(",  ")",  "{",  "}",  ">",  "<", "=", ".", ":", "|", ",", ";"};
    while (true) {
      if (pos_ >= s_.size())
        syntax_error(start_line, fmt::format("unexpected end of template, expected '{}'", block ? "%}" : "}}"));
      if (open.empty() && tag_end(block ? "%}" : "}}", block)) {
        out_.push_back({block ? Tok::BlockEnd : Tok::VarEnd, "", line_});
        return;
      }
      char c = s_[pos_];
      size_t n;
      if (py_space(decode_at(s_, pos_, &n))) {
        if (c == '\n') ++line_;
        pos_ += n;
      } else if (is_digit(c)) {
        number();
      } else if (is_alpha(c) || c == '_') {
        size_t e = pos_;
        while (e < s_.size() && (is_alpha(s_[e]) || is_digit(s_[e]) || s_[e] == '_')) ++e;
        out_.push_back({Tok::Name, s_.substr(pos_, e - pos_), line_});
        pos_ = e;
      } else if (c == '\'' || c == '"') {
        string_literal(c);
      } else {
        const char* op = nullptr;
        for (const char* o : ops)
          if (at(o)) {
            op = o;
            break;
          }
        if (!op) syntax_error(line_, fmt::format("unexpected char '{}'", c));
        if (size_t k = std::string_view("([{").find(op[0]); k != std::string_view::npos && op[1] == 0) open += ")]}"[k];
        if (std::string_view(")]}").find(op[0]) != std::string_view::npos && op[1] == 0) {
          if (open.empty()) syntax_error(line_, fmt::format("unexpected '{}'", op));
          if (open.back() != op[0]) syntax_error(line_, fmt::format("unexpected '{}', expected '{}'", op, open.back()));
          open.pop_back();
        }
        out_.push_back({Tok::Op, op, line_});
        pos_ += std::strlen(op);
      }
    }
  }

  void number() {
    if (s_[pos_] == '0' && pos_ + 2 < s_.size() && std::strchr("xXoObB", s_[pos_ + 1]) &&
        std::isxdigit(static_cast<unsigned char>(s_[pos_ + 2]))) {
      size_t e = pos_ + 2;
      while (e < s_.size() && (std::isxdigit(static_cast<unsigned char>(s_[e])) || s_[e] == '_')) ++e;
      std::string text = s_.substr(pos_, e - pos_);
      text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
      out_.push_back({Tok::Int, text, line_});
      pos_ = e;
      return;
    }
    auto digits = [&](size_t p) {
      size_t e = p;
      while (e < s_.size() && (is_digit(s_[e]) || (s_[e] == '_' && e + 1 < s_.size() && is_digit(s_[e + 1])))) ++e;
      return e;
    };
    size_t e = digits(pos_);
    bool is_float = false;
    bool after_dot = pos_ > 0 && s_[pos_ - 1] == '.';  // "x.0.1" is attribute access, not a float
    if (!after_dot && e + 1 < s_.size() && s_[e] == '.' && is_digit(s_[e + 1])) e = digits(e + 1), is_float = true;
    if (!after_dot && e < s_.size() && (s_[e] == 'e' || s_[e] == 'E')) {
      size_t x = e + 1;
      if (x < s_.size() && (s_[x] == '+' || s_[x] == '-')) ++x;
      if (x < s_.size() && is_digit(s_[x])) e = digits(x), is_float = true;
    }
    std::string text = s_.substr(pos_, e - pos_);
    text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
    out_.push_back({is_float ? Tok::Float : Tok::Int, text, line_});
    pos_ = e;
  }

  void string_literal(char q) {
    size_t e = pos_ + 1;
    int start_line = line_;
    while (e < s_.size() && s_[e] != q) e += s_[e] == '\\' ? 2 : 1;
    if (e >= s_.size()) syntax_error(start_line, "unterminated string literal");
    std::string body = s_.substr(pos_ + 1, e - pos_ - 1);
    line_ += std::count(body.begin(), body.end(), '\n');
    out_.push_back({Tok::String, unescape(body, start_line), start_line});
    pos_ = e + 1;
  }

  std::string s_;
  size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;
  std::vector<Token> out_;
};

// ---------------------------------------------------------------------------------------------
// AST

enum class EK {
  Literal,
  Name,
  List,
  Dict,
  Attr,
  Item,
  Slice,
  Call,
  Filter,
  Test,
  Not,
  Neg,
  Pos,
  And,
  Or,
  Binary,
  Compare,
  Cond
};

struct Expr;
using ExprP = std::unique_ptr<Expr>;
struct Expr {
  EK kind;
  int line;
  Value literal;            // Literal
  std::string name;         // Name, Attr, Filter, Test, Binary operator
  std::vector<ExprP> args;  // operands; Call/Filter/Test: subject or callee first, then positional
                            // args; Dict: key, value, key, ...; Slice: obj, start, stop, step (may be null)
  std::vector<std::pair<std::string, ExprP>> kwargs;
  std::vector<std::string> ops;  // Compare: operator before args[i + 1]
  bool negated = false;          // Test
  int depth = 1;                 // of the tree below, this node included
};

enum class SK { Text, Output, If, For, Set, SetAttr, SetBlock, Macro, Break, Continue, FilterBlock, Scoped };

struct Stmt;
using StmtP = std::unique_ptr<Stmt>;
using Body = std::vector<StmtP>;
struct Stmt {
  SK kind;
  int line;
  std::string text;                      // Text: the data; Macro: its name; SetAttr: the attribute
  std::vector<std::string> names;        // For/Set/SetBlock/SetAttr: targets; Macro: parameters; Scoped: names
  std::vector<ExprP> exprs;              // If: conditions; For: iterable, then filter (may be null); Set/Output:
                                         // value; Macro: parameter defaults (may be null); Scoped: values;
                                         // SetBlock/FilterBlock: optional filter chain over kBodyVar
  std::vector<Body> bodies;              // If: one per condition, then else; For: body, else; others: body
  bool varargs = false, kwargs = false;  // Macro: whether the body reads `varargs` / `kwargs`
};

// Filter blocks bind their rendered body to this name, which no template can spell.
constexpr const char* kBodyVar = " body";

// ---------------------------------------------------------------------------------------------
// Parser (jinja2/parser.py)

class Parser {
 public:
  explicit Parser(std::vector<Token> toks) : t_(std::move(toks)) {}

  Body parse_template() { return parse_body({}); }

 private:
  const Token& peek(size_t k = 0) const { return t_[std::min(pos_ + k, t_.size() - 1)]; }
  const Token& next() { return t_[std::min(pos_++, t_.size() - 1)]; }
  [[noreturn]] void fail(const Token& t, const std::string& msg) const { syntax_error(t.line, msg); }
  bool is_op(std::string_view op, size_t k = 0) const { return peek(k).type == Tok::Op && peek(k).text == op; }
  bool is_name(std::string_view n, size_t k = 0) const { return peek(k).type == Tok::Name && peek(k).text == n; }
  bool skip_op(std::string_view op) { return is_op(op) ? (++pos_, true) : false; }
  bool skip_name(std::string_view n) { return is_name(n) ? (++pos_, true) : false; }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case Tok::Eof: return "end of template";
      case Tok::BlockEnd: return "end of statement block";
      case Tok::VarEnd: return "end of print statement";
      case Tok::Data: return "template data";
      default: return "'" + t.text + "'";
    }
  }
  void expect_op(std::string_view op) {
    if (!skip_op(op)) fail(peek(), fmt::format("expected '{}', got {}", op, describe(peek())));
  }
  std::string expect_name() {
    if (peek().type != Tok::Name) fail(peek(), fmt::format("expected a name, got {}", describe(peek())));
    return next().text;
  }
  void expect_block_end() {
    if (peek().type != Tok::BlockEnd)
      fail(peek(), fmt::format("expected end of statement block, got {}", describe(peek())));
    ++pos_;
  }

  // Parses until a block tag named in `ends`; leaves the position on that tag's name.
  Body parse_body(std::initializer_list<std::string_view> ends, std::string_view opener = {}, int open_line = 0) {
    Body body;
    while (true) {
      const Token& t = peek();
      if (t.type == Tok::Eof) {
        if (ends.size() == 0) return body;
        syntax_error(open_line, fmt::format("'{}' is never closed (expected '{}')", opener, *ends.begin()));
      }
      if (t.type == Tok::Data) {
        body.push_back(stmt(SK::Text, t.line));
        body.back()->text = next().text;
      } else if (t.type == Tok::VarBegin) {
        ++pos_;
        auto s = stmt(SK::Output, t.line);
        s->exprs.push_back(parse_tuple());
        if (peek().type != Tok::VarEnd)
          fail(peek(), fmt::format("expected end of print statement, got {}", describe(peek())));
        ++pos_;
        body.push_back(std::move(s));
      } else if (t.type == Tok::BlockBegin) {
        const Token& name = peek(1);
        if (name.type == Tok::Name && std::find(ends.begin(), ends.end(), name.text) != ends.end()) {
          ++pos_;
          return body;
        }
        ++pos_;
        body.push_back(parse_statement());
      } else {
        fail(t, fmt::format("unexpected {}", describe(t)));
      }
    }
  }

  static StmtP stmt(SK k, int line) {
    auto s = std::make_unique<Stmt>();
    s->kind = k;
    s->line = line;
    return s;
  }

  StmtP parse_statement() {
    Nest nest(nesting_, peek().line);
    const Token& tok = peek();
    if (tok.type != Tok::Name) fail(tok, "tag name expected");
    std::string name = next().text;
    int line = tok.line;
    if (name == "if") return parse_if(line);
    if (name == "for") return parse_for(line);
    if (name == "set") return parse_set(line);
    if (name == "macro") return parse_macro(line);
    if (name == "break" || name == "continue") {
      if (loop_depth_ == 0) syntax_error(line, fmt::format("'{}' outside of a loop", name));
      expect_block_end();
      return stmt(name == "break" ? SK::Break : SK::Continue, line);
    }
    if (name == "filter") {
      auto s = stmt(SK::FilterBlock, line);
      s->exprs.push_back(parse_filter_chain(line));
      expect_block_end();
      s->bodies.push_back(parse_body({"endfilter"}, "filter", line));
      close_block();
      return s;
    }
    if (name == "with" || name == "generation") {  // generation: transformers' assistant-mask tag
      auto s = stmt(SK::Scoped, line);
      while (name == "with" && peek().type != Tok::BlockEnd) {
        if (!s->names.empty()) expect_op(",");
        s->names.push_back(expect_name());
        expect_op("=");
        s->exprs.push_back(parse_expr());
      }
      expect_block_end();
      std::string end = "end" + name;
      s->bodies.push_back(parse_body({end}, name, line));
      close_block();
      return s;
    }
    static const char* unsupported[] = {"extends", "block",      "include", "import", "from",
                                        "call",    "autoescape", "do",      "trans"};
    for (const char* u : unsupported)
      if (name == u) syntax_error(line, fmt::format("'{}' tags are not supported by this Jinja implementation", name));
    syntax_error(line, fmt::format("unknown or misplaced tag '{}'", name));
  }

  // Consumes "endX %}" after parse_body stopped on it.
  void close_block() {
    ++pos_;
    expect_block_end();
  }

  StmtP parse_if(int line) {
    auto s = stmt(SK::If, line);
    s->exprs.push_back(parse_tuple());
    expect_block_end();
    while (true) {
      s->bodies.push_back(parse_body({"elif", "else", "endif"}, "if", line));
      std::string kw = next().text;
      if (kw == "elif") {
        s->exprs.push_back(parse_tuple());
        expect_block_end();
      } else if (kw == "else") {
        expect_block_end();
        s->bodies.push_back(parse_body({"endif"}, "if", line));
        close_block();
        return s;
      } else {
        expect_block_end();
        return s;
      }
    }
  }

  std::vector<std::string> parse_targets() {
    std::vector<std::string> names;
    bool paren = skip_op("(");
    do {
      names.push_back(expect_name());
    } while (skip_op(",") && peek().type == Tok::Name && !is_name("in"));
    if (paren) expect_op(")");
    return names;
  }

  StmtP parse_for(int line) {
    auto s = stmt(SK::For, line);
    s->names = parse_targets();
    if (!skip_name("in")) fail(peek(), fmt::format("expected 'in', got {}", describe(peek())));
    s->exprs.push_back(parse_tuple(false));
    s->exprs.push_back(skip_name("if") ? parse_expr() : nullptr);
    if (is_name("recursive")) fail(peek(), "recursive loops are not supported");
    expect_block_end();
    ++loop_depth_;
    s->bodies.push_back(parse_body({"endfor", "else"}, "for", line));
    --loop_depth_;
    if (next().text == "else") {
      expect_block_end();
      s->bodies.push_back(parse_body({"endfor"}, "for", line));
      ++pos_;
    }
    expect_block_end();
    return s;
  }

  StmtP parse_set(int line) {
    std::string first = expect_name();
    if (skip_op(".")) {
      auto s = stmt(SK::SetAttr, line);
      s->names.push_back(first);
      s->text = expect_name();
      expect_op("=");
      s->exprs.push_back(parse_tuple());
      expect_block_end();
      return s;
    }
    std::vector<std::string> names{first};
    while (skip_op(",")) names.push_back(expect_name());
    if (skip_op("=")) {
      auto s = stmt(SK::Set, line);
      s->names = std::move(names);
      s->exprs.push_back(parse_tuple());
      expect_block_end();
      return s;
    }
    auto s = stmt(SK::SetBlock, line);
    s->names = std::move(names);
    if (is_op("|")) s->exprs.push_back(parse_filter_chain(line));
    expect_block_end();
    s->bodies.push_back(parse_body({"endset"}, "set", line));
    close_block();
    return s;
  }

  StmtP parse_macro(int line) {
    auto s = stmt(SK::Macro, line);
    s->text = expect_name();
    expect_op("(");
    while (!skip_op(")")) {
      if (!s->names.empty()) expect_op(",");
      if (skip_op(")")) break;
      s->names.push_back(expect_name());
      s->exprs.push_back(skip_op("=") ? parse_expr() : nullptr);
    }
    expect_block_end();
    int saved_depth = loop_depth_;
    loop_depth_ = 0;
    macro_reads_.push_back({false, false});
    s->bodies.push_back(parse_body({"endmacro"}, "macro", line));
    std::tie(s->varargs, s->kwargs) = macro_reads_.back();
    macro_reads_.pop_back();
    loop_depth_ = saved_depth;
    ++pos_;
    if (peek().type == Tok::Name) ++pos_;  // "{% endmacro name %}"
    expect_block_end();
    return s;
  }

  // "| f(args) | g" applied to kBodyVar, for filter blocks and block sets.
  ExprP parse_filter_chain(int line) {
    auto body = node(EK::Name, line);
    body->name = kBodyVar;
    if (!is_op("|")) {
      auto f = parse_filter(std::move(body));
      return parse_filters_only(std::move(f));
    }
    return parse_filters_only(std::move(body));
  }
  ExprP parse_filters_only(ExprP e) {
    while (skip_op("|")) e = parse_filter(std::move(e));
    return e;
  }

  static ExprP node(EK k, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->line = line;
    return e;
  }
  // Appends an operand. Chains ("a ~ b ~ c ...", "x.a.b ...") deepen the tree without
  // recursion in the parser, so the depth is counted here.
  static void deepen(Expr& parent, const Expr& child) {
    parent.depth = std::max(parent.depth, child.depth + 1);
    if (parent.depth > kMaxNesting)
      syntax_error(parent.line, fmt::format("expression nested more than {} levels deep", kMaxNesting));
  }
  static void add(Expr& parent, ExprP child) {
    if (child) deepen(parent, *child);
    parent.args.push_back(std::move(child));
  }
  // Entered by every construct the parser recurses into (brackets, unary operators, blocks).
  struct Nest {
    int& depth;
    Nest(int& d, int line) : depth(++d) {
      if (depth > kMaxNesting) syntax_error(line, fmt::format("nested more than {} levels deep", kMaxNesting));
    }
    ~Nest() { --depth; }
  };

  static ExprP binary(EK k, std::string op, ExprP a, ExprP b) {
    auto e = node(k, a->line);
    e->name = std::move(op);
    add(*e, std::move(a));
    add(*e, std::move(b));
    return e;
  }

  // An implicit tuple ("a, b") where jinja allows one; tuples are lists here.
  ExprP parse_tuple(bool with_condexpr = true) {
    int line = peek().line;
    ExprP first = parse_expr(with_condexpr);
    if (!is_op(",")) return first;
    auto list = node(EK::List, line);
    add(*list, std::move(first));
    while (skip_op(",")) {
      if (peek().type == Tok::BlockEnd || peek().type == Tok::VarEnd || is_op(")") || is_name("in")) break;
      add(*list, parse_expr(with_condexpr));
    }
    return list;
  }

  ExprP parse_expr(bool with_condexpr = true) { return with_condexpr ? parse_condexpr() : parse_or(); }

  ExprP parse_condexpr() {
    ExprP e = parse_or();
    while (skip_name("if")) {
      auto c = node(EK::Cond, e->line);
      ExprP test = parse_or();
      ExprP other = skip_name("else") ? parse_condexpr() : nullptr;
      add(*c, std::move(e));
      add(*c, std::move(test));
      add(*c, std::move(other));
      e = std::move(c);
    }
    return e;
  }

  ExprP parse_or() {
    Nest nest(nesting_, peek().line);
    ExprP e = parse_and();
    while (skip_name("or")) e = binary(EK::Or, "or", std::move(e), parse_and());
    return e;
  }
  ExprP parse_and() {
    ExprP e = parse_not();
    while (skip_name("and")) e = binary(EK::And, "and", std::move(e), parse_not());
    return e;
  }
  ExprP parse_not() {
    if (is_name("not")) {
      Nest nest(nesting_, peek().line);
      auto e = node(EK::Not, next().line);
      add(*e, parse_not());
      return e;
    }
    return parse_compare();
  }

  ExprP parse_compare() {
    ExprP first = parse_math1();
    ExprP cmp;
    while (true) {
      std::string op;
      if (peek().type == Tok::Op && (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
                                     peek().text == "<=" || peek().text == ">" || peek().text == ">=")) {
        op = next().text;
      } else if (skip_name("in")) {
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        pos_ += 2;
        op = "notin";
      } else {
        break;
      }
      if (!cmp) {
        cmp = node(EK::Compare, first->line);
        add(*cmp, std::move(first));
      }
      cmp->ops.push_back(op);
      add(*cmp, parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }

  ExprP parse_math1() {
    ExprP e = parse_concat();
    while (is_op("+") || is_op("-")) {
      std::string op = next().text;
      e = binary(EK::Binary, op, std::move(e), parse_concat());
    }
    return e;
  }
  ExprP parse_concat() {
    ExprP e = parse_math2();
    while (skip_op("~")) e = binary(EK::Binary, "~", std::move(e), parse_math2());
    return e;
  }
  ExprP parse_math2() {
    ExprP e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string op = next().text;
      e = binary(EK::Binary, op, std::move(e), parse_pow());
    }
    return e;
  }
  ExprP parse_pow() {
    ExprP e = parse_unary();
    while (skip_op("**")) e = binary(EK::Binary, "**", std::move(e), parse_unary());
    return e;
  }

  ExprP parse_unary(bool with_filter = true) {
    ExprP e;
    if (is_op("-") || is_op("+")) {
      Nest nest(nesting_, peek().line);
      EK kind = peek().text == "-" ? EK::Neg : EK::Pos;
      e = node(kind, next().line);
      add(*e, parse_unary(false));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    return with_filter ? parse_filter_expr(std::move(e)) : std::move(e);
  }

  ExprP parse_primary() {
    const Token& t = peek();
    int line = t.line;
    if (t.type == Tok::Name) {
      std::string n = next().text;
      auto lit = [&](Value v) {
        auto e = node(EK::Literal, line);
        e->literal = std::move(v);
        return e;
      };
      if (n == "true" || n == "True") return lit(bool_value(true));
      if (n == "false" || n == "False") return lit(bool_value(false));
      if (n == "none" || n == "None") return lit(none_value());
      if (!macro_reads_.empty() && n == "varargs") macro_reads_.back().first = true;
      if (!macro_reads_.empty() && n == "kwargs") macro_reads_.back().second = true;
      auto e = node(EK::Name, line);
      e->name = n;
      return e;
    }
    if (t.type == Tok::String) {
      std::string s;
      while (peek().type == Tok::String) s += next().text;
      auto e = node(EK::Literal, line);
      e->literal = Value::of(std::move(s));
      return e;
    }
    if (t.type == Tok::Int || t.type == Tok::Float) {
      std::string text = next().text;
      auto e = node(EK::Literal, line);
      if (t.type == Tok::Float) {
        e->literal = Value::of(std::strtod(text.c_str(), nullptr));
      } else {
        int base = 10;
        size_t skip = 0;
        if (text.size() > 2 && text[0] == '0' && std::strchr("xXoObB", text[1])) {
          base = std::strchr("xX", text[1]) ? 16 : std::strchr("oO", text[1]) ? 8 : 2;
          skip = 2;
        }
        int64_t v = 0;
        auto r = std::from_chars(text.data() + skip, text.data() + text.size(), v, base);
        if (r.ec != std::errc()) syntax_error(line, fmt::format("integer literal {} is out of range", text));
        e->literal = Value::of(v);
      }
      return e;
    }
    if (skip_op("(")) {
      if (skip_op(")")) return node(EK::List, line);
      ExprP e = parse_expr();
      if (is_op(",")) {
        auto list = node(EK::List, line);
        add(*list, std::move(e));
        while (skip_op(",") && !is_op(")")) add(*list, parse_expr());
        e = std::move(list);
      }
      expect_op(")");
      return e;
    }
    if (skip_op("[")) {
      auto e = node(EK::List, line);
      while (!skip_op("]")) {
        if (!e->args.empty()) expect_op(",");
        if (skip_op("]")) break;
        add(*e, parse_expr());
      }
      return e;
    }
    if (skip_op("{")) {
      auto e = node(EK::Dict, line);
      while (!skip_op("}")) {
        if (!e->args.empty()) expect_op(",");
        if (skip_op("}")) break;
        add(*e, parse_expr());
        expect_op(":");
        add(*e, parse_expr());
      }
      return e;
    }
    fail(t, fmt::format("unexpected {}", describe(t)));
  }

  ExprP parse_postfix(ExprP e) {
    while (true) {
      int line = peek().line;
      if (skip_op(".")) {
        if (peek().type == Tok::Int) {  // foo.0 is foo[0]
          auto idx = node(EK::Literal, line);
          const std::string digits = next().text;
          int64_t index = 0;
          if (std::from_chars(digits.data(), digits.data() + digits.size(), index).ec != std::errc())
            syntax_error(line, fmt::format("index {} is out of range", digits));
          idx->literal = Value::of(index);
          auto item = node(EK::Item, line);
          add(*item, std::move(e));
          add(*item, std::move(idx));
          e = std::move(item);
        } else {
          auto a = node(EK::Attr, line);
          a->name = expect_name();
          add(*a, std::move(e));
          e = std::move(a);
        }
      } else if (skip_op("[")) {
        e = parse_subscript(std::move(e), line);
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprP parse_subscript(ExprP obj, int line) {
    ExprP start;
    if (!is_op(":")) {
      start = parse_expr();
      if (skip_op("]")) {
        auto item = node(EK::Item, line);
        add(*item, std::move(obj));
        add(*item, std::move(start));
        return item;
      }
    }
    expect_op(":");
    auto s = node(EK::Slice, line);
    add(*s, std::move(obj));
    add(*s, std::move(start));
    add(*s, is_op(":") || is_op("]") ? nullptr : parse_expr());
    add(*s, skip_op(":") && !is_op("]") ? parse_expr() : nullptr);
    expect_op("]");
    return s;
  }

  // Parses "(args, kw=value)" into e->args (after what is already there) and e->kwargs.
  void parse_call_args(Expr& e) {
    expect_op("(");
    bool first = true;
    while (!skip_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (skip_op(")")) break;
      if (is_op("*") || is_op("**")) fail(peek(), "*args and **kwargs in calls are not supported");
      if (peek().type == Tok::Name && is_op("=", 1)) {
        std::string k = next().text;
        ++pos_;
        ExprP v = parse_expr();
        deepen(e, *v);
        e.kwargs.emplace_back(k, std::move(v));
      } else {
        if (!e.kwargs.empty()) fail(peek(), "positional argument follows keyword argument");
        add(e, parse_expr());
      }
    }
  }

  ExprP parse_call(ExprP callee) {
    auto c = node(EK::Call, callee->line);
    add(*c, std::move(callee));
    parse_call_args(*c);
    return c;
  }

  ExprP parse_filter(ExprP subject) {
    int line = peek().line;
    auto f = node(EK::Filter, line);
    f->name = expect_name();
    if (!filter_table().count(f->name)) syntax_error(line, fmt::format("unsupported filter '{}'", f->name));
    add(*f, std::move(subject));
    if (is_op("(")) parse_call_args(*f);
    return f;
  }

  ExprP parse_filter_expr(ExprP e) {
    while (true) {
      if (skip_op("|")) {
        e = parse_filter(std::move(e));
      } else if (is_name("is")) {
        int line = next().line;
        auto t = node(EK::Test, line);
        t->negated = skip_name("not");
        t->name = expect_name();
        if (!test_table().count(t->name)) syntax_error(line, fmt::format("unsupported test '{}'", t->name));
        add(*t, std::move(e));
        const Token& a = peek();
        if (is_op("(")) {
          parse_call_args(*t);
        } else if ((a.type == Tok::Name || a.type == Tok::String || a.type == Tok::Int || a.type == Tok::Float ||
                    is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and")) {
          if (is_name("is")) fail(a, "You cannot chain multiple tests with is");
          add(*t, parse_postfix(parse_primary()));
        }
        e = std::move(t);
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  std::vector<Token> t_;
  size_t pos_ = 0;
  int nesting_ = 0;
  int loop_depth_ = 0;
  std::vector<std::pair<bool, bool>> macro_reads_;  // per open macro: reads varargs, kwargs
};

// ---------------------------------------------------------------------------------------------
// Evaluation

struct Scope {
  std::shared_ptr<Scope> parent;
  std::vector<std::pair<std::string, Value>> vars;  // a handful per scope: a scan beats hashing

  Value* find(const std::string& name) {
    for (auto& [k, v] : vars)
      if (k == name) return &v;
    return nullptr;
  }
  void set(const std::string& name, Value v) {
    if (Value* slot = find(name))
      *slot = std::move(v);
    else
      vars.emplace_back(name, std::move(v));
  }
};
using ScopeP = std::shared_ptr<Scope>;

enum class Flow { Next, Break, Continue };

constexpr int kMaxMacroDepth = 200;
constexpr int64_t kMaxRange = 100000;  // jinja's sandbox limit

const std::unordered_map<std::string, Value>& globals();

struct Renderer {
  std::vector<ScopeP> macro_scopes;                   // cleared after rendering to break
  std::vector<std::shared_ptr<NamespaceObj>> spaces;  // macro <-> scope reference cycles
  int depth = 0;       // macro calls
  int eval_depth = 0;  // expressions being evaluated

  ~Renderer() {
    for (auto& s : macro_scopes) s->vars.clear();
    for (auto& n : spaces) n->attrs.clear();
  }

  static Value lookup(const ScopeP& sc, const std::string& name) {
    for (Scope* s = sc.get(); s; s = s->parent.get())
      if (const Value* v = s->find(name)) return *v;
    auto g = globals().find(name);
    return g != globals().end() ? g->second : Value::undef(name);
  }

  Value eval(const Expr& e, const ScopeP& sc) {
    try {
      if (eval_depth >= kMaxEvalDepth) raise("expressions and macro calls nested more than {} deep", kMaxEvalDepth);
      struct Nested {
        int& d;
        ~Nested() { --d; }
      } nested{++eval_depth};
      count_steps(1);
      return eval_node(e, sc);
    } catch (const EvalError& err) {
      throw Error(fmt::format("chat template line {}: {}", e.line, err.msg));
    }
  }

  Args eval_args(const Expr& e, const ScopeP& sc, size_t first) {
    Args a;
    for (size_t i = first; i < e.args.size(); ++i) a.pos.push_back(eval(*e.args[i], sc));
    for (const auto& [k, v] : e.kwargs) a.kw.emplace_back(k, eval(*v, sc));
    return a;
  }

  Value call(const Value& f, const Args& a) {
    if (f.kind == Value::Kind::Callable) return f.fn->call(*this, a);
    if (f.undefined()) raise_undefined(f);
    raise("'{}' object is not callable", type_name(f));
  }

  Value eval_node(const Expr& e, const ScopeP& sc) {
    auto arg = [&](size_t i) { return eval(*e.args[i], sc); };
    switch (e.kind) {
      case EK::Literal: return e.literal;
      case EK::Name: return lookup(sc, e.name);
      case EK::List: {
        Json arr = Json::array();
        for (auto& x : e.args) arr.push_back(to_json(eval(*x, sc)));
        return Value::of(std::move(arr));
      }
      case EK::Dict: {
        Json obj = Json::object();
        for (size_t i = 0; i < e.args.size(); i += 2) {
          Value k = arg(i);
          if (!k.is_str()) raise("dict literal keys must be strings here, not {}", type_name(k));
          obj[k.str()] = to_json(arg(i + 1));
        }
        return Value::of(std::move(obj));
      }
      case EK::Attr: return get_attr(arg(0), e.name);
      case EK::Item: return get_item(arg(0), arg(1));
      case EK::Slice: {
        Value obj = arg(0);
        auto opt = [&](size_t i) { return e.args[i] ? arg(i) : none_value(); };
        return slice(obj, opt(1), opt(2), opt(3));
      }
      case EK::Call: {
        Value f = arg(0);
        return call(f, eval_args(e, sc, 1));
      }
      case EK::Filter: {
        Value v = arg(0);
        return apply_filter(e.name, v, eval_args(e, sc, 1));
      }
      case EK::Test: {
        Value v = arg(0);
        return bool_value(apply_test(e.name, v, eval_args(e, sc, 1)) != e.negated);
      }
      case EK::Not: return bool_value(!truthy(arg(0)));
      case EK::Neg:
      case EK::Pos: {
        Value v = arg(0);
        if (v.undefined()) raise_undefined(v);
        if (!v.data() || !is_num(v.j()))
          raise("bad operand type for unary {}: '{}'", e.kind == EK::Neg ? '-' : '+', type_name(v));
        if (e.kind == EK::Pos) return is_int(v.j()) ? Value::of(as_int(v.j())) : v;
        if (!is_int(v.j())) return Value::of(-as_double(v.j()));
        int64_t neg = 0;
        if (__builtin_sub_overflow(int64_t{0}, as_int(v.j()), &neg)) raise("integer overflow in unary -");
        return Value::of(neg);
      }
      case EK::And: {
        Value l = arg(0);
        return truthy(l) ? arg(1) : l;
      }
      case EK::Or: {
        Value l = arg(0);
        return truthy(l) ? l : arg(1);
      }
      case EK::Binary: {
        Value l = arg(0), r = arg(1);
        if (e.name == "~") return Value::of(to_str(l) + to_str(r));
        return arith(e.name, l, r);
      }
      case EK::Compare: {
        Value left = arg(0);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = arg(i + 1);
          if (!compare(e.ops[i], left, right)) return bool_value(false);
          left = std::move(right);
        }
        return bool_value(true);
      }
      case EK::Cond:
        if (truthy(arg(1))) return arg(0);
        return e.args[2] ? arg(2) : Value::undef("conditional expression");
    }
    return Value::undef("?");
  }

  void assign(const std::vector<std::string>& names, const Value& v, Scope& sc) {
    if (names.size() == 1) {
      sc.set(names[0], v);
      return;
    }
    std::vector<Value> parts = iterate(v);
    if (parts.size() < names.size())
      raise("not enough values to unpack (expected {}, got {})", names.size(), parts.size());
    if (parts.size() > names.size()) raise("too many values to unpack (expected {})", names.size());
    for (size_t i = 0; i < names.size(); ++i) sc.set(names[i], parts[i]);
  }

  Flow exec(const Body& body, const ScopeP& sc, std::string& out) {
    for (const StmtP& sp : body) {
      const Stmt& s = *sp;
      try {
        Flow f = exec_one(s, sc, out);
        if (f != Flow::Next) return f;
      } catch (const EvalError& err) {
        throw Error(fmt::format("chat template line {}: {}", s.line, err.msg));
      }
    }
    return Flow::Next;
  }

  Flow exec_one(const Stmt& s, const ScopeP& sc, std::string& out) {
    count_steps(1);
    switch (s.kind) {
      case SK::Text:
        count_bytes(int64_t(s.text.size()));
        out += s.text;
        return Flow::Next;
      case SK::Output: {
        std::string text = to_str(eval(*s.exprs[0], sc));
        count_bytes(int64_t(text.size()));
        out += text;
        return Flow::Next;
      }
      case SK::If:
        for (size_t i = 0; i < s.bodies.size(); ++i)
          if (i == s.exprs.size() || truthy(eval(*s.exprs[i], sc))) return exec(s.bodies[i], sc, out);
        return Flow::Next;
      case SK::For: return exec_for(s, sc, out);
      case SK::Set: assign(s.names, eval(*s.exprs[0], sc), *sc); return Flow::Next;
      case SK::SetAttr: {
        Value target = lookup(sc, s.names[0]);
        if (target.kind != Value::Kind::Namespace) raise("cannot assign attribute on non-namespace object");
        target.ns->attrs[s.text] = eval(*s.exprs[0], sc);
        return Flow::Next;
      }
      case SK::SetBlock:
      case SK::FilterBlock: {
        auto inner = std::make_shared<Scope>(Scope{sc, {}});
        std::string buf;
        exec(s.bodies[0], inner, buf);
        Value v = Value::of(std::move(buf));
        if (!s.exprs.empty()) {
          inner->set(kBodyVar, v);
          v = eval(*s.exprs[0], inner);
        }
        if (s.kind == SK::FilterBlock)
          out += to_str(v);
        else
          assign(s.names, v, *sc);
        return Flow::Next;
      }
      case SK::Macro: {
        const Stmt* def = &s;
        ScopeP closure = sc;
        macro_scopes.push_back(sc);
        sc->set(s.text, make_callable(s.text, [def, closure](Renderer& r, const Args& a) {
                  return r.call_macro(*def, closure, a);
                }));
        return Flow::Next;
      }
      case SK::Break: return Flow::Break;
      case SK::Continue: return Flow::Continue;
      case SK::Scoped: {
        auto inner = std::make_shared<Scope>(Scope{sc, {}});
        for (size_t i = 0; i < s.names.size(); ++i) inner->set(s.names[i], eval(*s.exprs[i], sc));
        return exec(s.bodies[0], inner, out);
      }
    }
    return Flow::Next;
  }

  // Each iteration gets a fresh scope: jinja forgets loop-body assignments between iterations.
  Flow exec_for(const Stmt& s, const ScopeP& sc, std::string& out) {
    std::vector<Value> items = iterate(eval(*s.exprs[0], sc));
    if (s.exprs[1]) {
      std::vector<Value> kept;
      for (Value& it : items) {
        auto probe = std::make_shared<Scope>(Scope{sc, {}});
        assign(s.names, it, *probe);
        if (truthy(eval(*s.exprs[1], probe))) kept.push_back(std::move(it));
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      if (s.bodies.size() < 2) return Flow::Next;
      auto inner = std::make_shared<Scope>(Scope{sc, {}});
      return exec(s.bodies[1], inner, out);
    }
    auto loop = std::make_shared<LoopObj>();
    loop->items = std::make_shared<const std::vector<Value>>(std::move(items));
    Value loop_value;
    loop_value.kind = Value::Kind::Loop;
    loop_value.loop = loop;
    for (size_t i = 0; i < loop->items->size(); ++i) {
      count_steps(1);
      loop->index = i;
      auto inner = std::make_shared<Scope>(Scope{sc, {}});
      assign(s.names, (*loop->items)[i], *inner);
      inner->set("loop", loop_value);
      if (exec(s.bodies[0], inner, out) == Flow::Break) break;
    }
    return Flow::Next;
  }

  Value call_macro(const Stmt& def, const ScopeP& closure, const Args& a) {
    if (depth >= kMaxMacroDepth) raise("macro '{}' recursed more than {} levels", def.text, kMaxMacroDepth);
    struct DepthGuard {
      int& d;
      ~DepthGuard() { --d; }
    } guard{++depth};
    auto sc = std::make_shared<Scope>(Scope{closure, {}});
    size_t np = def.names.size();
    if (a.pos.size() > np && !def.varargs) raise("macro '{}' takes not more than {} argument(s)", def.text, np);
    std::vector<bool> given(np, false);
    for (size_t i = 0; i < std::min(np, a.pos.size()); ++i) {
      sc->set(def.names[i], a.pos[i]);
      given[i] = true;
    }
    Json extra_kw = Json::object();
    for (const auto& [k, v] : a.kw) {
      auto it = std::find(def.names.begin(), def.names.end(), k);
      if (it != def.names.end()) {
        size_t i = it - def.names.begin();
        if (given[i]) raise("macro '{}' got multiple values for argument '{}'", def.text, k);
        sc->set(k, v);
        given[i] = true;
      } else if (def.kwargs) {
        extra_kw[k] = to_json(v);
      } else {
        raise("macro '{}' has no argument named '{}'", def.text, k);
      }
    }
    for (size_t i = 0; i < np; ++i)
      if (!given[i]) sc->set(def.names[i], def.exprs[i] ? eval(*def.exprs[i], sc) : Value::undef(def.names[i]));
    if (def.varargs)
      sc->set("varargs", list_value(a.pos.size() > np ? std::vector<Value>(a.pos.begin() + np, a.pos.end())
                                                      : std::vector<Value>{}));
    if (def.kwargs) sc->set("kwargs", Value::of(std::move(extra_kw)));
    std::string out;
    exec(def.bodies[0], sc, out);
    return Value::of(std::move(out));
  }
};

const std::unordered_map<std::string, Value>& globals() {
  static const std::unordered_map<std::string, Value> g = {
      {"range", make_callable("range",
                              [](Renderer&, const Args& a) {
                                if (!a.kw.empty() || a.pos.empty() || a.pos.size() > 3)
                                  raise("range expected 1 to 3 positional arguments");
                                std::vector<int64_t> n;
                                for (const Value& v : a.pos) n.push_back(opt_int(v, 0, "range() argument"));
                                int64_t start = n.size() > 1 ? n[0] : 0, stop = n.size() > 1 ? n[1] : n[0];
                                int64_t step = n.size() > 2 ? n[2] : 1;
                                if (step == 0) raise("range() arg 3 must not be zero");
                                Json out = Json::array();
                                for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
                                  if (static_cast<int64_t>(out.size()) >= kMaxRange)
                                    raise("range too big, maximum size for range is {}", kMaxRange);
                                  out.push_back(i);
                                  if (__builtin_add_overflow(i, step, &i)) break;
                                }
                                return Value::of(std::move(out));
                              })},
      {"namespace", make_callable("namespace",
                                  [](Renderer& r, const Args& a) {
                                    Value v;
                                    v.kind = Value::Kind::Namespace;
                                    v.ns = std::make_shared<NamespaceObj>();
                                    r.spaces.push_back(v.ns);
                                    for (const Value& init : a.pos) {
                                      if (!init.data() || !init.j().is_object())
                                        raise("namespace() positional arguments must be dicts");
                                      for (auto it = init.j().begin(); it != init.j().end(); ++it)
                                        v.ns->attrs[it.key()] = init.child(it.value());
                                    }
                                    for (const auto& [k, x] : a.kw) v.ns->attrs[k] = x;
                                    return v;
                                  })},
      {"dict", make_callable("dict",
                             [](Renderer&, const Args& a) {
                               Json out = Json::object();
                               for (const Value& init : a.pos) {
                                 if (!init.data() || !init.j().is_object())
                                   raise("dict() positional argument must be a dict");
                                 for (auto it = init.j().begin(); it != init.j().end(); ++it)
                                   out[it.key()] = it.value();
                               }
                               for (const auto& [k, x] : a.kw) out[k] = to_json(x);
                               return Value::of(std::move(out));
                             })},
      {"raise_exception", make_callable("raise_exception",
                                        [](Renderer&, const Args& a) -> Value {
                                          raise("raise_exception: {}", a.pos.empty() ? "" : to_str(a.pos[0]));
                                        })},
      {"strftime_now", make_callable("strftime_now",
                                     [](Renderer&, const Args& a) {
                                       if (a.pos.size() != 1 || !a.pos[0].is_str())
                                         raise("strftime_now(format) needs a format string");
                                       std::time_t now = std::time(nullptr);
                                       std::tm tm{};
                                       localtime_r(&now, &tm);
                                       char buf[512];
                                       size_t n = std::strftime(buf, sizeof buf, a.pos[0].str().c_str(), &tm);
                                       return Value::of(std::string(buf, n));
                                     })},
  };
  return g;
}

}  // namespace

struct Template::Program {
  Body body;
};

Template::Template(const std::string& source) {
  auto p = std::make_shared<Program>();
  p->body = Parser(Lexer(source).run()).parse_template();
  program_ = std::move(p);
}

namespace {
std::atomic<int64_t> g_max_steps{RenderLimits{}.steps}, g_max_bytes{RenderLimits{}.bytes};
}  // namespace

RenderLimits render_limits() { return {g_max_steps.load(), g_max_bytes.load()}; }

RenderLimits set_render_limits(const RenderLimits& limits) {
  MB_CHECK(limits.steps > 0 && limits.bytes > 0, "render limits must be positive");
  return {g_max_steps.exchange(limits.steps), g_max_bytes.exchange(limits.bytes)};
}

void check_nesting(const Json& value) {
  try {
    json_cost(value);
  } catch (const EvalError& e) {
    fail("chat template input: {}", e.msg);
  }
}

std::string Template::render(const Json& variables) const {
  if (!variables.is_object()) fail("chat template variables must be a JSON object, got {}", variables.type_name());
  check_nesting(variables);
  const RenderLimits limits = render_limits();
  Meter meter{limits.steps, limits.bytes, limits};
  struct Restore {
    Meter* prev;
    ~Restore() { t_meter = prev; }
  } restore{std::exchange(t_meter, &meter)};
  auto owner = std::make_shared<const Json>(variables);
  auto root = std::make_shared<Scope>();
  for (auto it = owner->begin(); it != owner->end(); ++it) {
    Value v;
    v.kind = Value::Kind::Data;
    v.owner = owner;
    v.node = &it.value();
    root->set(it.key(), std::move(v));
  }
  Renderer r;
  r.macro_scopes.push_back(root);
  std::string out;
  r.exec(program_->body, root, out);
  return out;
}

}  // namespace mb::jinja
