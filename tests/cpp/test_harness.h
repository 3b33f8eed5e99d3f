// A deliberately tiny test harness, so the plan tests build with nothing but a C++17 compiler.
//
// TEST(name) registers a function. CHECK / CHECK_EQ / CHECK_THROWS record a failure (file:line and
// the values) and let the test go on, so one run reports every broken property. run_all() prints
// "ok name" or "FAIL name: ..." per test, then "N passed, M failed", and returns 1 on any failure.
#pragma once

#include <exception>
#include <iostream>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace xdev_test {

struct TestCase {
  const char* name;
  void (*fn)();
};

// Function-local statics: tests register from several translation units, whose static
// initialisation order is unspecified.
inline std::vector<TestCase>& registry() {
  static std::vector<TestCase> tests;
  return tests;
}
inline std::vector<std::string>& failures() {  // of the test now running
  static std::vector<std::string> messages;
  return messages;
}

struct Registrar {
  Registrar(const char* name, void (*fn)()) { registry().push_back({name, fn}); }
};

inline void fail(const char* file, int line, const std::string& what) {
  failures().push_back(std::string(file) + ":" + std::to_string(line) + ": " + what);
}

template <typename T, typename = void>
struct Printable : std::false_type {};
template <typename T>
struct Printable<T, std::void_t<decltype(std::declval<std::ostream&>() << std::declval<T>())>>
    : std::true_type {};

// Values without an operator<< still compare; they print as "?".
template <typename T>
std::string show(const T& v) {
  std::ostringstream os;
  if constexpr (Printable<const T&>::value) {
    os << v;
  } else {
    os << "?";
  }
  return os.str();
}

template <typename A, typename B>
void check_eq(const A& a, const B& b, const char* what, const char* file, int line) {
  if (!(a == b)) fail(file, line, what + show(a) + " vs " + show(b));
}

inline int run_all() {
  int passed = 0, failed = 0;
  for (const TestCase& t : registry()) {
    failures().clear();
    try {
      t.fn();
    } catch (const std::exception& e) {
      failures().push_back(std::string("uncaught exception: ") + e.what());
    } catch (...) {
      failures().push_back("uncaught non-standard exception");
    }
    if (failures().empty()) {
      ++passed;
      std::cout << "ok " << t.name << "\n";
      continue;
    }
    ++failed;
    std::cout << "FAIL " << t.name << ": " << failures().front();
    if (failures().size() > 1) std::cout << " (and " << failures().size() - 1 << " more)";
    std::cout << "\n";
  }
  std::cout << passed << " passed, " << failed << " failed" << std::endl;
  return failed == 0 ? 0 : 1;
}

}  // namespace xdev_test

#define TEST(name)                                                                     \
  static void xdev_test_##name();                                                      \
  static const ::xdev_test::Registrar xdev_registrar_##name(#name, &xdev_test_##name); \
  static void xdev_test_##name()

#define CHECK(cond) \
  ((cond) ? (void)0 : ::xdev_test::fail(__FILE__, __LINE__, "CHECK(" #cond ") failed"))

// Each operand is evaluated exactly once; the comparison lives in a function so every CHECK_EQ
// expands to one call (the tests have hundreds).
#define CHECK_EQ(a, b) \
  ::xdev_test::check_eq((a), (b), "CHECK_EQ(" #a ", " #b ") failed: ", __FILE__, __LINE__)

// Passes when stmt throws exc_type whose what() contains substr ("" accepts any message).
#define CHECK_THROWS(stmt, exc_type, substr)                                                 \
  do {                                                                                       \
    std::string xdev_outcome = "no exception";                                               \
    try {                                                                                    \
      stmt;                                                                                  \
    } catch (const exc_type& e) {                                                            \
      const std::string what = e.what();                                                     \
      xdev_outcome = what.find(substr) != std::string::npos ? "" : "message '" + what + "'"; \
    } catch (const std::exception& e) {                                                      \
      xdev_outcome = std::string("other exception '") + e.what() + "'";                      \
    }                                                                                        \
    if (!xdev_outcome.empty()) {                                                             \
      ::xdev_test::fail(__FILE__, __LINE__,                                                  \
                        "CHECK_THROWS(" #stmt ", " #exc_type "): " + xdev_outcome);          \
    }                                                                                        \
  } while (0)
