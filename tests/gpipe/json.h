// A small JSON reader for tests that check files gpipe writes (Chrome traces): objects, arrays,
// strings (with the common escapes), numbers, true, false, null. Throws std::runtime_error on
// malformed input, so that a broken file fails the test that reads it.
#pragma once

#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace gpipe_test {

struct Json {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject } type = Type::kNull;
  bool boolean = false;
  double number = 0;
  std::string string;
  std::vector<Json> array;
  std::map<std::string, Json> object;

  const Json& operator[](const std::string& key) const {
    auto it = object.find(key);
    if (type != Type::kObject || it == object.end()) {
      throw std::runtime_error("json: no key '" + key + "'");
    }
    return it->second;
  }
  bool has(const std::string& key) const { return object.count(key) > 0; }

  static Json parse(const std::string& text) {
    size_t pos = 0;
    Json value = parse_value(text, pos);
    skip_space(text, pos);
    if (pos != text.size()) fail(text, pos, "trailing characters");
    return value;
  }

 private:
  [[noreturn]] static void fail(const std::string& text, size_t pos, const std::string& what) {
    throw std::runtime_error("json: " + what + " at offset " + std::to_string(pos) + ": '" +
                             text.substr(pos, 20) + "'");
  }
  static void skip_space(const std::string& t, size_t& p) {
    while (p < t.size() && (t[p] == ' ' || t[p] == '\n' || t[p] == '\r' || t[p] == '\t')) ++p;
  }
  static void expect(const std::string& t, size_t& p, char c) {
    skip_space(t, p);
    if (p >= t.size() || t[p] != c) fail(t, p, std::string("expected '") + c + "'");
    ++p;
  }
  static std::string parse_string(const std::string& t, size_t& p) {
    expect(t, p, '"');
    std::string out;
    while (p < t.size() && t[p] != '"') {
      if (t[p] == '\\') {
        ++p;
        if (p >= t.size()) fail(t, p, "unterminated escape");
        switch (t[p]) {
          case 'n': out += '\n'; break;
          case 't': out += '\t'; break;
          case 'r': out += '\r'; break;
          case '"': out += '"'; break;
          case '\\': out += '\\'; break;
          case '/': out += '/'; break;
          default: fail(t, p, "unsupported escape");
        }
        ++p;
      } else {
        if (static_cast<unsigned char>(t[p]) < 0x20) fail(t, p, "control character in string");
        out += t[p++];
      }
    }
    if (p >= t.size()) fail(t, p, "unterminated string");
    ++p;
    return out;
  }
  static Json parse_value(const std::string& t, size_t& p) {
    skip_space(t, p);
    if (p >= t.size()) fail(t, p, "unexpected end");
    Json v;
    const char c = t[p];
    if (c == '{') {
      v.type = Type::kObject;
      ++p;
      skip_space(t, p);
      if (p < t.size() && t[p] == '}') return ++p, v;
      while (true) {
        std::string key = parse_string(t, p);
        expect(t, p, ':');
        v.object[key] = parse_value(t, p);
        skip_space(t, p);
        if (p < t.size() && t[p] == ',') { ++p; continue; }
        expect(t, p, '}');
        return v;
      }
    }
    if (c == '[') {
      v.type = Type::kArray;
      ++p;
      skip_space(t, p);
      if (p < t.size() && t[p] == ']') return ++p, v;
      while (true) {
        v.array.push_back(parse_value(t, p));
        skip_space(t, p);
        if (p < t.size() && t[p] == ',') { ++p; continue; }
        expect(t, p, ']');
        return v;
      }
    }
    if (c == '"') {
      v.type = Type::kString;
      v.string = parse_string(t, p);
      return v;
    }
    for (const char* word : {"true", "false", "null"}) {
      const std::string w(word);
      if (t.compare(p, w.size(), w) == 0) {
        p += w.size();
        v.type = w == "null" ? Type::kNull : Type::kBool;
        v.boolean = w == "true";
        return v;
      }
    }
    const char* begin = t.c_str() + p;
    char* end = nullptr;
    v.number = std::strtod(begin, &end);
    if (end == begin) fail(t, p, "unexpected character");
    v.type = Type::kNumber;
    p += static_cast<size_t>(end - begin);
    return v;
  }
};

}  // namespace gpipe_test
