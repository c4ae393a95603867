// What the balancing files share (internal, not API): medians and elapsed times, JSON fields read
// with errors that name the key, layer profiles as JSON objects (for a whole profile and for a
// pipeline's profile alike), and a list of devices without repeats.
#pragma once

#include <algorithm>
#include <chrono>
#include <string>
#include <type_traits>
#include <vector>

#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "balancing/profile.h"

namespace gpipe {
namespace internal {

/// The median of `values` (not empty): the middle one, or the mean of the two middle ones.
inline double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t h = values.size() / 2;
  return values.size() % 2 == 1 ? values[h] : (values[h - 1] + values[h]) / 2;
}

/// Microseconds since `since`.
inline double elapsed_us(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - since)
      .count();
}

/// `text` as JSON, or an error "<who>: not JSON: <the parser's message>".
inline nlohmann::json parse_json(const std::string& text, const std::string& who) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, who, ": not JSON: ", e.what());
  }
}

/// `object[key]` as T, or an error naming `who`, the key and what it holds.
template <typename T>
T json_field(const nlohmann::json& object, const char* key, const std::string& who) {
  TORCH_CHECK(object.is_object() && object.contains(key), who, ": no \"", key, "\" in ",
              object.dump().substr(0, 200));
  try {
    return object.at(key).get<T>();
  } catch (const nlohmann::json::exception& e) {
    const char* kind = std::is_same<T, bool>::value          ? "boolean"
                       : std::is_arithmetic<T>::value        ? "number"
                       : std::is_same<T, std::string>::value ? "string"
                                                             : "value of the expected shape";
    TORCH_CHECK(false, who, ": \"", key, "\" is ", object.at(key).dump().substr(0, 100),
                ", not a ", kind, " (", e.what(), ")");
  }
}

/// A layer profile as the JSON object LayerProfile::to_json writes, and back (errors name `who`).
nlohmann::json layer_profile_json(const LayerProfile& profile);
LayerProfile layer_profile_from_json(const nlohmann::json& j, const std::string& who);

/// `devices` in order of first appearance, each once.
std::vector<c10::Device> distinct_devices(const std::vector<c10::Device>& devices);

}  // namespace internal
}  // namespace gpipe
