// Tests with several processes: the test binary runs itself again, once per rank, with torchrun's
// environment (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT) and only the test case that
// asked, which then takes its rank's branch. Results come back through files in a shared folder.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

extern char** environ;

namespace gpipe_test {

/// This process's rank when it was started by run_ranks, else -1.
inline int test_rank() {
  const char* rank = std::getenv("GPIPE_TEST_RANK");
  return rank != nullptr ? std::atoi(rank) : -1;
}

/// The folder that run_ranks shares with the ranks (in a rank process).
inline std::string test_folder() {
  const char* folder = std::getenv("GPIPE_TEST_FOLDER");
  return folder != nullptr ? folder : "";
}

/// A TCP port that was free a moment ago on loopback.
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return 29500 + static_cast<int>(::getpid() % 1000);
  }
  const int port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

struct RankResult {
  int exit_code = -1;  // -1: killed (ran past the time limit) or did not start
  std::string output;
};

/// Runs the test case `test_name` of this binary in `world` processes (ranks 0 .. world - 1) and
/// waits for them, killing any still running after `limit`. `extra_env` is added to each one's
/// environment. Returns each rank's exit code and output; the folder the ranks wrote to is
/// `folder` (made empty first). The test's name must have no comma: Catch2 reads a comma on its
/// command line as a separator between test specs, and the ranks would run nothing.
inline std::vector<RankResult> run_ranks(const std::string& test_name, int world,
                                         const std::string& folder,
                                         const std::map<std::string, std::string>& extra_env = {},
                                         std::chrono::seconds limit = std::chrono::seconds(180)) {
  if (test_name.find(',') != std::string::npos) {
    throw std::invalid_argument("run_ranks: the test name '" + test_name + "' has a comma, "
                                "which Catch2 takes for a separator between test specs; name "
                                "the test without one");
  }
  std::filesystem::remove_all(folder);
  std::filesystem::create_directories(folder);
  const std::string port = std::to_string(free_port());
  std::vector<pid_t> pids(world, -1);
  for (int rank = 0; rank < world; ++rank) {
    std::map<std::string, std::string> vars = {
        {"GPIPE_TEST_RANK", std::to_string(rank)}, {"GPIPE_TEST_FOLDER", folder},
        {"RANK", std::to_string(rank)}, {"WORLD_SIZE", std::to_string(world)},
        {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port},
        // As torchrun does for several processes on one host: one intra-op thread each, so that
        // the ranks' thread pools do not crowd each other's cores.
        {"OMP_NUM_THREADS", "1"}};
    for (const auto& kv : extra_env) vars[kv.first] = kv.second;
    // This process's environment but the variables set here (getenv takes the first).
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      if (vars.count(entry.substr(0, entry.find('='))) == 0) env.push_back(entry);
    }
    for (const auto& kv : vars) env.push_back(kv.first + "=" + kv.second);
    std::vector<char*> envp;
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::string exe = "/proc/self/exe";
    std::string name = test_name;
    std::vector<char*> argv{exe.data(), name.data(), nullptr};
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    const std::string log = folder + "/rank" + std::to_string(rank) + ".log";
    posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    pid_t pid = -1;
    if (posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv.data(), envp.data()) == 0) {
      pids[rank] = pid;
    }
    posix_spawn_file_actions_destroy(&actions);
  }
  std::vector<RankResult> results(world);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (int rank = 0; rank < world; ++rank) {
    if (pids[rank] < 0) continue;
    int status = 0;
    while (::waitpid(pids[rank], &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pids[rank], SIGKILL);
        ::waitpid(pids[rank], &status, 0);
        status = -1;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    results[rank].exit_code = status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::ifstream in(folder + "/rank" + std::to_string(rank) + ".log");
    std::stringstream text;
    text << in.rdbuf();
    results[rank].output = text.str();
  }
  return results;
}

/// Writes `values` (float64, any shapes) to `path`, flattened.
inline void write_doubles(const std::string& path, const std::vector<at::Tensor>& values) {
  std::ofstream out(path, std::ios::binary);
  for (const at::Tensor& v : values) {
    const at::Tensor flat = v.detach().to(at::kCPU, at::kDouble).contiguous().reshape(-1);
    if (flat.numel() == 0) continue;
    out.write(reinterpret_cast<const char*>(flat.data_ptr<double>()),
              static_cast<std::streamsize>(flat.numel() * sizeof(double)));
  }
}

/// Reads what write_doubles wrote, as one float64 tensor.
inline at::Tensor read_doubles(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<double> values(bytes.size() / sizeof(double));
  if (values.empty()) return at::empty({0}, at::kDouble);  // (memcpy takes no null pointers)
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(double));
  return at::from_blob(values.data(), {static_cast<int64_t>(values.size())}, at::kDouble).clone();
}

/// A fresh folder name for the ranks of test `name` of suite `suite` to share.
inline std::string folder_for(const std::string& suite, const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("gpipe_" + suite + "_" + name + "_" + std::to_string(::getpid())))
      .string();
}

/// `tensors` flattened into one float64 vector.
inline at::Tensor flat(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> pieces;
  for (const at::Tensor& t : tensors) pieces.push_back(t.detach().to(at::kDouble).reshape(-1));
  // (A stage without parameters has an empty state.)
  return pieces.empty() ? at::empty({0}, at::kDouble) : at::cat(pieces);
}

/// Everything the ranks printed, for a failure message.
inline std::string outputs(const std::vector<RankResult>& results) {
  std::string text;
  for (size_t r = 0; r < results.size(); ++r) {
    text += "--- rank " + std::to_string(r) + " (exit " + std::to_string(results[r].exit_code) +
            ")\n" + results[r].output;
  }
  return text;
}

}  // namespace gpipe_test
