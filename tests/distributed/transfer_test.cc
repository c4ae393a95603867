// Activations between stages over Gloo: one message per micro-batch (Note [One message per
// micro-batch] in gpipe/distributed/internal/transfer.h): packing keeps every dtype and shape, and
// micro-batches larger than any before (which travel as two messages) still train to the plain
// model. Between stages on one host, rings of shared memory (Note [Shared memory between stages
// on one host] in gpipe/distributed/internal/shared_memory.h): order, wrapping, room, and giving up.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/randn.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "gpipe/distributed/internal/fault.h"
#include "gpipe/distributed/internal/remote_link.h"
#include "gpipe/distributed/pipeline_stage.h"
#include "gpipe/distributed/internal/shared_memory.h"
#include "gpipe/distributed/internal/transfer.h"
#include "tests/catch.h"
#include "tests/distributed/multiprocess.h"

namespace gpipe {
namespace distributed {
namespace {

namespace nn = torch::nn;

// A batch of 64 tensors whose header entries (3 values each, plus one per dimension) take
// `words` values in all.
Batch batch_of_header_words(int64_t words) {
  std::vector<at::Tensor> tensors;
  int64_t dims = words - 64 * 3;  // spread over the 64 tensors
  for (int64_t k = 0; k < 64; ++k) {
    const int64_t d = dims / (64 - k);
    tensors.push_back(at::zeros(std::vector<int64_t>(d, 1), at::kFloat));
    dims -= d;
  }
  return Batch(tensors);
}

CATCH_TEST_CASE("an activation header holds exactly what fits in its 512 values, refuses one "
                "more, and a malformed one from a peer is refused naming what is wrong",
                "[distributed][transfer][errors]") {
  // Five values come before the entries: 507 values of entries fill the header.
  const internal::BatchHeader full =
      internal::BatchHeader::of(batch_of_header_words(507), 2, /*grad_enabled=*/true);
  const at::Tensor encoded = full.encode();
  CATCH_CHECK(encoded.numel() == internal::BatchHeader::size());
  CATCH_CHECK(encoded.numel() == 512);
  const internal::BatchHeader decoded = internal::BatchHeader::decode(encoded);
  CATCH_REQUIRE(decoded.entries.size() == 64);
  for (size_t k = 0; k < 64; ++k) {
    CATCH_CHECK(decoded.entries[k].sizes == full.entries[k].sizes);
    CATCH_CHECK(decoded.entries[k].dtype == at::kFloat);
  }
  CATCH_CHECK_THROWS_WITH(
      internal::BatchHeader::of(batch_of_header_words(508), 2, /*grad_enabled=*/true),
      gpipe_test::contains("(513 values, at most 512)"));
  // From a peer: a dtype that is no dtype, a negative size.
  at::Tensor bad_dtype = encoded.clone();
  bad_dtype[5] = 1000;
  CATCH_CHECK_THROWS_WITH(internal::BatchHeader::decode(bad_dtype, 1, 0),
                          gpipe_test::contains("on rank 1, from rank 0") &&
                              gpipe_test::contains("tensor 0 has dtype number 1000"));
  at::Tensor bad_size = encoded.clone();
  bad_size[8] = -3;  // tensor 0's first size (dtype, requires_grad, dims, then sizes)
  CATCH_CHECK_THROWS_WITH(internal::BatchHeader::decode(bad_size, 1, 0),
                          gpipe_test::contains("tensor 0 has a size of -3"));
  // Sizes whose bytes overflow an int64 (2^40 x 2^40 x 4 bytes).
  at::Tensor huge = encoded.clone();
  huge[8] = int64_t{1} << 40;
  huge[9] = int64_t{1} << 40;
  CATCH_CHECK_THROWS_WITH(internal::BatchHeader::decode(huge, 1, 0),
                          gpipe_test::contains("over a petabyte"));
  // A shape that holds nothing yet overflows an int64 when multiplied in order (2^62 x 3 x 0):
  // its numel, bytes and strides must not be computed (UBSan caught this from the fuzz test).
  at::Tensor empty_but_huge = encoded.clone();
  empty_but_huge[8] = int64_t{1} << 62;
  empty_but_huge[9] = 3;
  empty_but_huge[10] = 0;
  CATCH_CHECK_THROWS_WITH(internal::BatchHeader::decode(empty_but_huge, 1, 0),
                          gpipe_test::contains("non-zero sizes multiply to over a petabyte"));
  // An atomic batch (one tensor, not a tuple) that says it has none.
  at::Tensor atomic =
      internal::BatchHeader::of(Batch(at::ones({2, 3})), 2, /*grad_enabled=*/true).encode();
  CATCH_CHECK(internal::BatchHeader::decode(atomic).entries.size() == 1);
  atomic[4] = 0;
  CATCH_CHECK_THROWS_WITH(internal::BatchHeader::decode(atomic, 1, 0),
                          gpipe_test::contains("(0 tensors, 2 micro-batches, atomic)"));
}

CATCH_TEST_CASE("packed activations keep every tensor's dtype shape and values",
                "[distributed][transfer]") {
  const std::vector<at::Tensor> tensors{
      at::randn({3, 5}, at::kDouble),
      at::randn({2, 3, 1}, at::kFloat).to(at::kHalf),
      at::arange(7, at::kLong),
      at::arange(5, at::kLong) > 2,             // bool, 5 bytes
      at::arange(3, at::kByte),                 // 3 bytes: the next one starts aligned again
      at::randn({0, 4}, at::kFloat),            // no elements
      at::randn({}, at::kDouble),               // a scalar
      at::randn({4, 6}, at::kFloat).t(),        // not contiguous: to_wire makes it so
  };
  const Batch batch(tensors);
  const internal::BatchHeader header = internal::BatchHeader::of(batch, 3, /*grad_enabled=*/true);
  const std::vector<at::Tensor> wire = internal::to_wire(tensors, c10::Device(c10::kCPU));
  const int64_t header_bytes = internal::BatchHeader::size() * 8;
  const int64_t data_bytes = internal::packed_data_bytes(header);
  // With the header, and without (the second message of a micro-batch that did not fit).
  const at::Tensor message = internal::pack_activations(wire, header.encode());
  const at::Tensor data_only = internal::pack_activations(wire);
  CATCH_REQUIRE(message.numel() == header_bytes + data_bytes);
  CATCH_REQUIRE(data_only.numel() == data_bytes);
  const internal::BatchHeader decoded =
      internal::BatchHeader::decode(message.narrow(0, 0, header_bytes).view(at::kLong));
  CATCH_CHECK(decoded.microbatches == 3);
  for (const at::Tensor& data : {message.narrow(0, header_bytes, data_bytes), data_only}) {
    const std::vector<at::Tensor> out = internal::unpack_activations(decoded, data);
    CATCH_REQUIRE(out.size() == tensors.size());
    for (size_t k = 0; k < tensors.size(); ++k) {
      CATCH_CAPTURE(k);
      CATCH_CHECK(out[k].scalar_type() == tensors[k].scalar_type());
      CATCH_CHECK(out[k].sizes() == tensors[k].sizes());
      CATCH_CHECK(at::equal(out[k], tensors[k]));
    }
  }
}

// Rows of each step's mini-batch: step 1's micro-batches are larger than step 0's (two messages
// each), step 2's smaller (one), step 3's as large as step 1's (one).
const std::vector<int64_t> kRows{4, 8, 6, 8};
constexpr int64_t kChunks = 3;

nn::Sequential mlp() {
  torch::manual_seed(11);
  nn::Sequential seq(nn::Linear(5, 7), nn::Tanh(), nn::Linear(7, 7), nn::Tanh(), nn::Linear(7, 2));
  seq->to(at::kDouble);
  return seq;
}

std::pair<at::Tensor, at::Tensor> batch(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  const int64_t rows = kRows[static_cast<size_t>(step)];
  return {at::randn({rows, 5}, gen, at::kDouble), at::randn({rows, 2}, gen, at::kDouble)};
}

at::Tensor mse(const Batch& output, const at::Tensor& target) {
  return nn::functional::mse_loss(output.tensor(), target);
}

constexpr const char* kGrowing =
    "micro-batches larger than any a link carried before still train two stages to the plain "
    "model";

CATCH_TEST_CASE(kGrowing, "[distributed][transfer]") {
  if (gpipe_test::test_rank() >= 0) {
    const char* name = std::getenv("GPIPE_TEST_SCHEDULE");
    ProcessGroup group =
        new_gloo_group(options_from_env().timeout(std::chrono::seconds(60)));
    // Over Gloo (shared memory, the default between processes of one host, has no capacity).
    PipelineStage stage(
        mlp(),
        PipelineStageOptions({2, 3}).chunks(kChunks).schedule(schedule_kind(name)).shared_memory(0),
        group);
    torch::optim::SGD sgd(stage->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < static_cast<int>(kRows.size()); ++step) {
      auto [x, y] = batch(step);
      sgd.zero_grad();
      if (stage->is_first()) {
        stage->step(Batch(x), {}, mse);
      } else {
        stage->step(no_input(), y, mse);
      }
      sgd.step();
    }
    gpipe_test::write_doubles(gpipe_test::test_folder() + "/state" +
                                  std::to_string(gpipe_test::test_rank()) + ".bin",
                              stage->parameters());
    return;
  }
  const std::string schedule = GENERATE("gpipe", "1f1b");
  const std::string folder = gpipe_test::folder_for("transfer", "growing_" + schedule);
  const auto results =
      gpipe_test::run_ranks(kGrowing, 2, folder, {{"GPIPE_TEST_SCHEDULE", schedule}});
  CATCH_INFO(gpipe_test::outputs(results));
  for (const auto& r : results) CATCH_REQUIRE(r.exit_code == 0);
  nn::Sequential plain = mlp();
  torch::optim::SGD sgd(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < static_cast<int>(kRows.size()); ++step) {
    auto [x, y] = batch(step);
    sgd.zero_grad();
    nn::functional::mse_loss(plain->forward(x), y).backward();
    sgd.step();
  }
  std::vector<at::Tensor> stage0, stage1;
  const std::vector<at::Tensor> params = plain->parameters();
  for (size_t k = 0; k < params.size(); ++k) (k < 2 ? stage0 : stage1).push_back(params[k]);
  const at::Tensor got0 = gpipe_test::read_doubles(folder + "/state0.bin");
  const at::Tensor got1 = gpipe_test::read_doubles(folder + "/state1.bin");
  CATCH_CHECK(at::allclose(got0, gpipe_test::flat(stage0), 0, 1e-10));
  CATCH_CHECK(at::allclose(got1, gpipe_test::flat(stage1), 0, 1e-10));
  std::filesystem::remove_all(folder);
}

// A ring of the smallest size, labelled uniquely to this process and test: its writer and its
// reader.
struct TestRing {
  std::string name;
  std::unique_ptr<internal::SharedRing> writer, reader;
};
TestRing test_ring(const char* what) {
  const std::string name = "gpipe-test-" + std::to_string(getpid()) + "-" + what;
  auto writer = internal::SharedRing::create(name, internal::kMinSharedRing);
  const internal::PeerProcess self(getpid());
  return {name, std::move(writer), internal::SharedRing::open(self, name)};
}

// Whether /dev/shm holds a file whose name contains `label`.
bool in_dev_shm(const std::string& label) {
  if (!std::filesystem::exists("/dev/shm")) return false;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    if (entry.path().filename().string().find(label) != std::string::npos) return true;
  }
  return false;
}

// A wait on no other process, for a minute at most.
const internal::RingWait kMinute{"test messages", nullptr, std::chrono::minutes(1), nullptr};

CATCH_TEST_CASE("a shared-memory ring passes messages of any size in order, wrapping around its "
                "end, and leaves no name behind",
                "[distributed][transfer][shared_memory]") {
  TestRing ring = test_ring("order");
  internal::SharedRing* writer = ring.writer.get();
  internal::SharedRing* reader = ring.reader.get();
  CATCH_CHECK_FALSE(in_dev_shm(ring.name));
  CATCH_CHECK(writer->writer() == getpid());
  CATCH_CHECK(writer->max_message() == internal::kMinSharedRing / 2 - 64);
  const internal::RingWait& wait = kMinute;
  CATCH_CHECK(writer->reserve(writer->max_message() + 1, /*block=*/true, wait) == nullptr);
  // Sizes from 0 to the largest, 300 messages: the ring (256 KiB) wraps many times, the writer
  // waiting for room while the reader is behind.
  const auto size_of = [&](int k) {
    return k % 50 == 0 ? writer->max_message() : int64_t{(k * 7919) % 70001};
  };
  constexpr int kMessages = 300;
  std::thread write([&] {
    for (int k = 0; k < kMessages; ++k) {
      const int64_t n = size_of(k);
      uint8_t* out = writer->reserve(n, /*block=*/true, wait);
      for (int64_t b = 0; b < n; ++b) out[b] = static_cast<uint8_t>(k + b * 31);
      writer->commit();
    }
  });
  int wrong = 0;
  for (int k = 0; k < kMessages; ++k) {
    int64_t n = -1;
    const uint8_t* in = reader->next(&n, wait);
    CATCH_CHECK(reinterpret_cast<uintptr_t>(in) % 64 == 0);
    if (n != size_of(k)) ++wrong;
    for (int64_t b = 0; b < n && b < size_of(k); ++b) {
      if (in[b] != static_cast<uint8_t>(k + b * 31)) {
        ++wrong;
        break;
      }
    }
    reader->release();
  }
  write.join();
  CATCH_CHECK(wrong == 0);
}

CATCH_TEST_CASE("a shared-memory record whose size is not one the writer makes is refused",
                "[distributed][transfer][shared_memory][errors]") {
  TestRing ring = test_ring("malformed");
  uint8_t* out = ring.writer->reserve(100, /*block=*/true, kMinute);
  CATCH_REQUIRE(out != nullptr);
  // The record's size, in the 64 bytes before the message: one no writer makes (negative as an
  // int64, but not the wrap marker).
  const uint64_t bad = (uint64_t{1} << 63) | 100;
  std::memcpy(out - 64, &bad, sizeof(bad));
  ring.writer->commit();
  int64_t n = 0;
  CATCH_CHECK_THROWS_WITH(ring.reader->next(&n, kMinute),
                          gpipe_test::contains("a malformed record in shared memory"));
}

// Note [Fuzzing what a peer sends]: valid activation headers of random batches, mutated at
// random places to values at the edges (negative, zero, the limits, huge, dtype numbers that are
// none or not carried), and headers of random words; records of random sizes and bytes in a
// shared-memory ring; and valid activation records in a ring, mutated at random (the micro-batch,
// the length, header words, data bytes) and decoded as a stage decodes them (activations_of).
// Each must be read (and then unpack into tensors of what it says) or refused
// with a c10::Error naming where it came from; nothing else (no other exception, and no crash or
// undefined behaviour: CI runs this under ASan and UBSan with LibTorch 2.6).

// A header's value at the edges, or a random one.
int64_t edge_value(std::mt19937_64& random) {
  static const int64_t kEdges[] = {0, 1, 2, 3, 4, -1, -2, 63, 64, 65, 511, 512,
                                   std::numeric_limits<int32_t>::max(), int64_t{1} << 40,
                                   int64_t{1} << 62, std::numeric_limits<int64_t>::max(),
                                   std::numeric_limits<int64_t>::min(),
                                   static_cast<int64_t>(at::ScalarType::Undefined),
                                   static_cast<int64_t>(at::ScalarType::NumOptions),
                                   static_cast<int64_t>(at::ScalarType::QInt8)};
  const uint64_t pick = random() % (std::size(kEdges) + 4);
  return pick < std::size(kEdges) ? kEdges[pick] : static_cast<int64_t>(random());
}

// The encoded header of a random batch of 1 to 6 small tensors.
at::Tensor random_header(std::mt19937_64& random) {
  static const at::ScalarType kTypes[] = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16,
                                          at::kLong, at::kInt, at::kBool, at::kByte};
  const int64_t count = 1 + static_cast<int64_t>(random() % 6);
  std::vector<at::Tensor> values;
  for (int64_t k = 0; k < count; ++k) {
    std::vector<int64_t> sizes(random() % 4);
    for (int64_t& size : sizes) size = static_cast<int64_t>(random() % 4);
    values.push_back(at::empty(sizes, kTypes[random() % std::size(kTypes)]));
  }
  const bool atomic = count == 1 && random() % 2 == 0;
  const Batch batch = atomic ? Batch(values[0]) : Batch(values);
  return internal::BatchHeader::of(batch, 1 + static_cast<int64_t>(random() % 8), random() % 2 == 0)
      .encode();
}

CATCH_TEST_CASE("activation headers from a peer, random or mutated, are read or refused with an "
                "error naming the ranks, never anything else",
                "[distributed][transfer][errors][fuzz]") {
  std::mt19937_64 random(20261128);
  int64_t read = 0, refused = 0;
  std::vector<std::string> wrong;
  for (int64_t n = 0; n < 100000; ++n) {
    at::Tensor encoded;
    if (n % 10 == 0) {
      encoded = at::empty({internal::BatchHeader::size()}, at::kLong);
      int64_t* words = encoded.data_ptr<int64_t>();
      for (int64_t k = 0; k < encoded.numel(); ++k) words[k] = edge_value(random);
    } else {
      encoded = random_header(random);
      int64_t* words = encoded.data_ptr<int64_t>();
      for (uint64_t m = 1 + random() % 4; m > 0; --m) {
        // Mostly where the batch's entries are.
        words[random() % (random() % 4 == 0 ? internal::BatchHeader::size() : 40)] =
            edge_value(random);
      }
    }
    try {
      const internal::BatchHeader header = internal::BatchHeader::decode(encoded, 1, 0);
      const int64_t bytes = internal::packed_data_bytes(header);
      if (bytes < 0) wrong.push_back("negative packed bytes " + std::to_string(bytes));
      if (bytes <= (int64_t{1} << 16)) {
        const std::vector<at::Tensor> tensors =
            internal::unpack_activations(header, at::zeros({bytes}, at::kByte));
        for (size_t k = 0; k < tensors.size(); ++k) {
          if (tensors[k].sizes() != c10::IntArrayRef(header.entries[k].sizes) ||
              tensors[k].scalar_type() != header.entries[k].dtype) {
            wrong.push_back("an unpacked tensor differs from its header's entry");
          }
        }
      }
      ++read;
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      if (message.find("on rank 1, from rank 0: gpipe::distributed: a malformed activation "
                       "header arrived") == std::string::npos) {
        wrong.push_back(message);
      }
      ++refused;
    } catch (const std::exception& e) {
      wrong.push_back(std::string("not a c10::Error: ") + e.what());
    }
  }
  CATCH_INFO((wrong.empty() ? std::string() : wrong.front()));
  CATCH_CHECK(wrong.empty());
  // Both outcomes were exercised, many times.
  CATCH_CHECK(read > 10000);
  CATCH_CHECK(refused > 10000);
}

CATCH_TEST_CASE("shared-memory records of random sizes and bytes are read within the ring or "
                "refused with an error naming the link, never anything else",
                "[distributed][transfer][shared_memory][errors][fuzz]") {
  std::mt19937_64 random(20261129);
  int64_t read = 0, refused = 0;
  std::vector<std::string> wrong;
  const internal::RingWait wait{"activations from rank 0 on rank 1", nullptr,
                                std::chrono::minutes(1), nullptr};
  for (int64_t n = 0; n < 2000; ++n) {
    TestRing ring = test_ring("fuzz");
    const int64_t length = static_cast<int64_t>(random() % 5000);
    uint8_t* out = ring.writer->reserve(length, /*block=*/true, kMinute);
    CATCH_REQUIRE(out != nullptr);
    for (int64_t k = 0; k < length; ++k) out[k] = static_cast<uint8_t>(random());
    if (random() % 2 == 0) {
      // The record's size (the 64 bytes before the message) from no writer.
      const uint64_t size = static_cast<uint64_t>(edge_value(random));
      std::memcpy(out - 64, &size, sizeof(size));
    }
    ring.writer->commit();
    internal::SharedLink link;
    link.in = ring.reader.get();
    try {
      const internal::SharedLink::Record record = link.read(wait);
      if (record.bytes < 0 || record.bytes > internal::kMinSharedRing) {
        wrong.push_back("a record of " + std::to_string(record.bytes) + " bytes");
      }
      volatile uint8_t sum = 0;  // every byte it says it has can be read (ASan watches)
      for (int64_t k = 0; k < record.bytes; ++k) sum = static_cast<uint8_t>(sum + record.data[k]);
      ++read;
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      if (message.find("activations from rank 0 on rank 1") == std::string::npos) {
        wrong.push_back(message);
      }
      ++refused;
    }
  }
  CATCH_INFO((wrong.empty() ? std::string() : wrong.front()));
  CATCH_CHECK(wrong.empty());
  CATCH_CHECK(read > 100);
  CATCH_CHECK(refused > 100);
}

CATCH_TEST_CASE(
    "shared-memory records of activations from a peer, valid ones mutated at random "
    "bytes, are decoded or refused with an error naming the ranks, never anything else",
    "[distributed][transfer][shared_memory][errors][fuzz]") {
  std::mt19937_64 random(20261130);
  int64_t read = 0, refused = 0;
  std::vector<std::string> wrong;
  TestRing ring = test_ring("record_fuzz");
  internal::SharedLink link;
  link.out = ring.writer.get();
  link.in = ring.reader.get();
  for (int64_t n = 0; n < 100000; ++n) {
    // A valid record, as a stage writes it: micro-batch n's header and tensors of random bytes.
    const at::Tensor encoded = random_header(random);
    std::vector<at::Tensor> tensors =
        internal::BatchHeader::decode(encoded, 1, 0).empty_tensors(c10::Device(c10::kCPU));
    for (at::Tensor& t : tensors) {
      uint8_t* bytes = static_cast<uint8_t*>(t.data_ptr());
      for (size_t k = 0; k < t.nbytes(); ++k) bytes[k] = static_cast<uint8_t>(random());
    }
    CATCH_REQUIRE(link.write(n, encoded, tensors, kMinute));
    internal::SharedLink::Record record = link.read(kMinute);
    // What a peer could have written instead: the prefix's micro-batch, the record's length
    // (within what the ring holds), header words, data bytes.
    uint8_t* data = const_cast<uint8_t*>(record.data);
    for (uint64_t m = random() % 5; m > 0; --m) {
      switch (random() % 4) {
        case 0:
          record.microbatch = random() % 2 == 0 ? n + 1 : edge_value(random);
          break;
        case 1:
          record.bytes = static_cast<int64_t>(random() % static_cast<uint64_t>(record.bytes + 1));
          break;
        case 2: {
          const int64_t word = static_cast<int64_t>(random() % 40);  // where the entries are
          const int64_t value = edge_value(random);
          std::memcpy(data + 8 * word, &value, sizeof(value));
          break;
        }
        default:
          if (record.bytes > 0)
            data[random() % static_cast<uint64_t>(record.bytes)] = static_cast<uint8_t>(random());
      }
    }
    try {
      const internal::ActivationReceiver::Received r = internal::activations_of(record, n, 1, 0);
      // Taken only when it is the micro-batch due and holds every byte its header says.
      if (record.microbatch != n)
        wrong.push_back("micro-batch " + std::to_string(record.microbatch));
      if (internal::kHeaderBytes + internal::packed_data_bytes(r.header) > record.bytes) {
        wrong.push_back("a record shorter than its header says, taken");
      }
      for (size_t k = 0; k < r.tensors.size(); ++k) {
        if (r.tensors[k].sizes() != c10::IntArrayRef(r.header.entries[k].sizes) ||
            r.tensors[k].scalar_type() != r.header.entries[k].dtype) {
          wrong.push_back("an unpacked tensor differs from its header's entry");
        }
      }
      ++read;
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      if (message.find("on rank 1, from rank 0") == std::string::npos) wrong.push_back(message);
      ++refused;
    } catch (const std::exception& e) {
      wrong.push_back(std::string("not a c10::Error: ") + e.what());
    }
    link.release();
  }
  CATCH_INFO((wrong.empty() ? std::string() : wrong.front()));
  CATCH_CHECK(wrong.empty());
  CATCH_CHECK(read > 10000);
  CATCH_CHECK(refused > 10000);
}

CATCH_TEST_CASE("a full shared-memory ring refuses a message without waiting and keeps room for "
                "the records that say it went another way",
                "[distributed][transfer][shared_memory]") {
  TestRing ring = test_ring("full");
  internal::SharedRing* writer = ring.writer.get();
  internal::SharedRing* reader = ring.reader.get();
  const internal::RingWait& wait = kMinute;
  int64_t fitted = 0;
  while (uint8_t* out = writer->reserve(30000, /*block=*/false, wait)) {
    std::memset(out, 1, 30000);
    writer->commit();
    ++fitted;
  }
  // 256 KiB less the 64 KiB kept free, in records of 30000 + 64 bytes (rounded to 64).
  CATCH_CHECK(fitted == (internal::kMinSharedRing - 64 * 1024) / (30016 + 64));
  for (int k = 0; k < 100; ++k) {  // small records still fit, without a reader
    uint8_t* out = writer->reserve(64, /*block=*/true, wait);
    CATCH_REQUIRE(out != nullptr);
    std::memset(out, 2, 64);
    writer->commit();
  }
  for (int64_t k = 0; k < fitted + 100; ++k) {
    int64_t n = 0;
    const uint8_t* in = reader->next(&n, wait);
    CATCH_CHECK(n == (k < fitted ? 30000 : 64));
    CATCH_CHECK(in[n - 1] == (k < fitted ? 1 : 2));
    reader->release();
  }
  CATCH_CHECK(writer->reserve(30000, /*block=*/false, wait) != nullptr);  // room again
}

CATCH_TEST_CASE("a wait in a shared-memory ring gives up when the step is cancelled, at the "
                "timeout, and when the other process has exited",
                "[distributed][transfer][shared_memory]") {
  TestRing ring = test_ring("waits");
  internal::SharedRing* writer = ring.writer.get();
  internal::SharedRing* reader = ring.reader.get();
  int64_t n = 0;
  // Another stage's failure, heard while this one waits.
  internal::Cancellation cancellation;
  std::thread cancel([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    cancellation.cancel("stage 1 of 2 failed: a layer threw");
  });
  const internal::RingWait cancelled{"activations", nullptr, std::chrono::minutes(1),
                                     &cancellation};
  CATCH_CHECK_THROWS_WITH(reader->next(&n, cancelled),
                          gpipe_test::contains("stage 1 of 2 failed: a layer threw"));
  cancel.join();
  // The group's timeout.
  const internal::RingWait timed{"activations from rank 0", nullptr, std::chrono::milliseconds(100),
                                 nullptr};
  CATCH_CHECK_THROWS_WITH(reader->next(&n, timed),
                          gpipe_test::contains("for activations from rank 0 in shared memory, "
                                               "past the group's timeout (100 ms)"));
  // A writer that exited (here a child not yet waited for: a zombie, as a rank whose launcher
  // has not reaped it).
  const pid_t child = fork();
  if (child == 0) _exit(0);
  CATCH_REQUIRE(child > 0);
  const internal::PeerProcess child_process(child);
  const internal::RingWait gone{"gradients", &child_process, std::chrono::minutes(1), nullptr};
  CATCH_CHECK_THROWS_WITH(reader->next(&n, gone),
                          gpipe_test::contains("other process (pid " + std::to_string(child) +
                                               ") has exited"));
  int status = 0;
  waitpid(child, &status, 0);
  // The writer too gives up waiting for room.
  while (writer->reserve(30000, /*block=*/false, timed) != nullptr) writer->commit();
  CATCH_CHECK_THROWS_WITH(writer->reserve(100000, /*block=*/true, timed),
                          gpipe_test::contains("past the group's timeout"));
}

CATCH_TEST_CASE(
    "a shared-memory ring whose writer is killed leaves nothing behind whether or not "
    "its reader had opened it",
    "[distributed][transfer][shared_memory][faults]") {
  const std::string label = "gpipe-test-" + std::to_string(getpid()) + "-killed-";
  int ready[2];
  CATCH_REQUIRE(pipe(ready) == 0);
  const pid_t child = fork();
  if (child == 0) {  // makes two rings, says so, and waits to be killed (never back in Catch2)
    try {
      close(ready[0]);
      auto opened = internal::SharedRing::create(label + "opened", internal::kMinSharedRing);
      auto unopened = internal::SharedRing::create(label + "unopened", internal::kMinSharedRing);
      uint8_t* out = opened->reserve(5, /*block=*/true, kMinute);
      std::memcpy(out, "hello", 5);
      opened->commit();
      const char byte = 1;
      if (write(ready[1], &byte, 1) != 1) _exit(1);
      for (;;) pause();
    } catch (...) {
      _exit(2);
    }
  }
  CATCH_REQUIRE(child > 0);
  close(ready[1]);  // so that the read ends if the child dies without writing
  char byte = 0;
  const bool made = read(ready[0], &byte, 1) == 1;
  close(ready[0]);
  if (!made) waitpid(child, nullptr, 0);
  CATCH_REQUIRE(made);
  const internal::PeerProcess writer(child);
  auto reader = internal::SharedRing::open(writer, label + "opened");
  CATCH_CHECK(reader->writer() == child);
  kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  // Neither ring left a name (the old rings in /dev/shm kept the unopened one's for good).
  CATCH_CHECK_FALSE(in_dev_shm(label));
  // The opened one is still the reader's until it lets go; the writer's exit is heard.
  int64_t n = 0;
  const internal::RingWait wait{"activations", &writer, std::chrono::minutes(1), nullptr};
  const uint8_t* in = reader->next(&n, wait);
  CATCH_CHECK(std::string(reinterpret_cast<const char*>(in), static_cast<size_t>(n)) == "hello");
  reader->release();
  CATCH_CHECK_THROWS_WITH(reader->next(&n, wait),
                          gpipe_test::contains("(pid " + std::to_string(child) + ") has exited"));
  // And the other one went with its writer: its open files are gone.
  CATCH_CHECK_THROWS_WITH(
      internal::SharedRing::open(writer, label + "unopened"),
      gpipe_test::contains("cannot open shared-memory ring " + label +
                           "unopened: opendir(\"/proc/" + std::to_string(child) + "/fd\")"));
}

CATCH_TEST_CASE("a shared-memory ring is opened only from its writer's own files",
                "[distributed][transfer][shared_memory][errors]") {
  const std::string label = "gpipe-test-" + std::to_string(getpid()) + "-owned";
  auto writer = internal::SharedRing::create(label, internal::kMinSharedRing);
  const internal::PeerProcess self(getpid());
  CATCH_CHECK_THROWS_WITH(
      internal::SharedRing::open(self, label + "-other"),
      gpipe_test::contains("cannot open shared-memory ring " + label +
                           "-other: it is not among the open files of process " +
                           std::to_string(getpid())));
  const internal::PeerProcess parent(getppid());
  CATCH_CHECK_THROWS_WITH(internal::SharedRing::open(parent, label),
                          gpipe_test::contains("not among the open files"));
  // Rings beyond an eighth of the memory left are refused before anything is allocated: one
  // huge, or many together.
  const auto no_room = gpipe_test::contains(
      "more than an eighth of the memory this process may "
      "still take");
  CATCH_CHECK_THROWS_WITH(internal::SharedRing::create(label + "-huge", int64_t{1} << 50), no_room);
  CATCH_CHECK_THROWS_WITH(internal::SharedRing::check_room(int64_t{1} << 20, int64_t{1} << 30),
                          no_room);
  internal::SharedRing::check_room(4, internal::kMinSharedRing);  // a stage's few small rings
}

// Makes the next process this one forks get pid `pid` (Linux's ns_last_pid, as CRIU restores
// processes); false where it cannot (not root, or another process took it first).
pid_t fork_as(pid_t pid) {
  std::ofstream last("/proc/sys/kernel/ns_last_pid");
  if (!(last << (pid - 1) << std::flush)) return -1;
  return fork();
}

CATCH_TEST_CASE("a peer process that exited reads as exited even when a new process has its pid",
                "[distributed][transfer][shared_memory][faults]") {
  // The pid check that this replaced (kill(pid, 0)) saw the new process and waited on.
  for (int attempt = 0; attempt < 20; ++attempt) {
    const pid_t first = fork();
    if (first == 0) _exit(0);
    CATCH_REQUIRE(first > 0);
    const internal::PeerProcess watched(first);
    int status = 0;
    waitpid(first, &status, 0);
    CATCH_CHECK(watched.exited());
    const pid_t second = fork_as(first);
    if (second == 0) {
      pause();
      _exit(0);
    }
    if (second < 0 && attempt == 0) {
      CATCH_WARN("not tried: this process cannot choose the next pid (ns_last_pid needs root)");
      return;
    }
    if (second < 0) continue;
    // While the new process holds the pid, the number alone says "alive"; the watch does not.
    const bool reused = second == first && kill(first, 0) == 0;
    if (reused) CATCH_CHECK(watched.exited());
    kill(second, SIGKILL);
    waitpid(second, &status, 0);
    if (reused) return;
  }
  CATCH_WARN("not tried: the pid was taken by other processes 20 times");
}

}  // namespace
}  // namespace distributed
}  // namespace gpipe
