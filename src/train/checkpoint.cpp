// Checkpoint directories, written to DIR.tmp then swapped in with renames.
#include <cmath>
#include <filesystem>
#include <fstream>

#include "octet/comm.h"
#include "octet/files.h"
#include "octet/train.h"

namespace octet {

namespace fs = std::filesystem;

namespace {

void write_json(const fs::path& path, const nlohmann::json& json) {
  std::ofstream out(path);
  out << json.dump(2) << "\n";
  out.flush();
  OCTET_CHECK(out.good(), "cannot write ", path.string(), " (disk full?)");
}

// The previous checkpoint stays intact until the new one is complete: the files and the
// directory reach the disk before the renames (fsync), so not even a power loss leaves a
// renamed directory with missing bytes.
void swap_in(const fs::path& temp, const fs::path& target) {
  for (const auto& entry : fs::directory_iterator(temp)) sync_to_disk(entry.path().string());
  sync_to_disk(temp.string());
  const fs::path old(target.string() + ".old");
  fs::remove_all(old);
  if (fs::exists(target)) fs::rename(target, old);
  fs::rename(temp, target);
  fs::path parent = target.parent_path();
  sync_to_disk(parent.empty() ? "." : parent.string());
  fs::remove_all(old);
}

// trainer.json's "files": each file's size and SHA-256, read back from the disk.
nlohmann::json file_digests(const fs::path& dir, const std::vector<std::string>& files) {
  nlohmann::json digests = nlohmann::json::object();
  for (const std::string& file : files) {
    digests[file] = {{"bytes", fs::file_size(dir / file)},
                     {"sha256", sha256_file((dir / file).string())}};
  }
  return digests;
}

// Against trainer.json's record, before a byte is parsed: a flipped bit, a truncated or
// swapped file is named. Checkpoints written before the record existed load unverified.
void verify_digests(const std::string& dir, const nlohmann::json& trainer,
                    const std::vector<std::string>& files) {
  if (!trainer.contains("files")) return;
  const nlohmann::json& digests = trainer["files"];
  OCTET_CHECK(digests.is_object(), "checkpoint '", dir,
              "': trainer.json 'files' expected an object, got ", digests.dump());
  for (const std::string& file : files) {
    const fs::path path = fs::path(dir) / file;
    std::error_code error;
    OCTET_CHECK(fs::is_regular_file(path, error), "checkpoint '", dir, "' is incomplete: missing ",
                file);
    OCTET_CHECK(digests.contains(file) && digests[file].is_object() &&
                    digests[file].contains("bytes") &&
                    digests[file]["bytes"].is_number_unsigned() &&
                    digests[file].contains("sha256") && digests[file]["sha256"].is_string(),
                "checkpoint '", dir, "': trainer.json 'files' expected {bytes, sha256} for ", file,
                ", got ", digests.contains(file) ? digests[file].dump() : "nothing");
    const uint64_t bytes = fs::file_size(path), recorded = digests[file]["bytes"].get<uint64_t>();
    OCTET_CHECK(bytes == recorded, "checkpoint '", dir, "': ", file, " is ", bytes,
                " bytes, trainer.json records ", recorded, " (truncated or replaced: corrupt)");
    const std::string digest = sha256_file(path.string());
    OCTET_CHECK(digest == digests[file]["sha256"].get<std::string>(), "checkpoint '", dir,
                "': ", file, " fails its checksum (SHA-256 ", digest, ", trainer.json records ",
                digests[file]["sha256"].get<std::string>(),
                "): the file is corrupt (a flipped bit on disk or in a copy)");
  }
}

// Runs `write` into the temporary directory; on any failure (a full disk, a quota) the
// temporary directory goes and the error says the previous checkpoint is intact.
template <typename Write>
void write_or_clean(const fs::path& temp, const std::string& dir, Write&& write) {
  try {
    write();
  } catch (const Error& error) {
    std::error_code ignored;
    fs::remove_all(temp, ignored);
    fail(detail::concat("checkpoint '", dir, "' not saved: ", error.what(),
                        "; the previous checkpoint there (if any) is intact"));
  } catch (const fs::filesystem_error& error) {
    std::error_code ignored;
    fs::remove_all(temp, ignored);
    fail(detail::concat("checkpoint '", dir, "' not saved: ", error.what(),
                        "; the previous checkpoint there (if any) is intact"));
  }
}

}  // namespace

bool has_nonfinite(const Tensor& tensor) {
  const DType dtype = tensor.dtype();
  if (!tensor.defined() || (dtype != DType::F32 && dtype != DType::BF16 && dtype != DType::F16)) {
    return false;
  }
  if (dtype == DType::F32) {
    const float* data = tensor.data<float>();
    for (int64_t i = 0; i < tensor.numel(); ++i) {
      if (!std::isfinite(data[i])) return true;
    }
    return false;
  }
  for (float value : tensor.to_floats()) {
    if (!std::isfinite(value)) return true;
  }
  return false;
}

std::string first_nonfinite(const TensorMap& tensors) {
  for (const auto& [name, tensor] : tensors) {
    if (has_nonfinite(tensor)) return name;
  }
  return "";
}

// Copies source to dir/name (name may hold one folder, as tokenizer/vocab.bpe).
void copy_into(const fs::path& dir, const std::string& name, const std::string& source) {
  OCTET_CHECK(!name.empty() && name.find("..") == std::string::npos && name[0] != '/',
              "checkpoint: expected a relative file name, got '", name, "'");
  const fs::path target = dir / name;
  std::error_code error;
  fs::create_directories(target.parent_path(), error);
  if (!error) fs::copy_file(source, target, fs::copy_options::overwrite_existing, error);
  OCTET_CHECK(!error, "checkpoint: cannot copy '", source, "' into it as ", name, ": ",
              error.message());
}

void save_checkpoint(const std::string& dir, const Checkpoint& checkpoint) {
  const fs::path target(dir), temp(dir + ".tmp");
  write_or_clean(temp, dir, [&] {
    fs::remove_all(temp);
    fs::create_directories(temp);
    save_safetensors((temp / "model.safetensors").string(), checkpoint.model);
    save_safetensors((temp / "optimizer.safetensors").string(), checkpoint.optimizer);
    nlohmann::json trainer = checkpoint.trainer;
    std::vector<std::string> files = {"model.safetensors", "optimizer.safetensors"};
    for (const auto& [name, source] : checkpoint.files) {
      copy_into(temp, name, source);
      files.push_back(name);
    }
    trainer["files"] = file_digests(temp, files);
    write_json(temp / "trainer.json", trainer);
    swap_in(temp, target);
  });
}

void save_checkpoint_sharded(const std::string& dir, const Checkpoint& part,
                             ParallelState& parallel) {
  const fs::path target(dir), temp(dir + ".tmp");
  Communicator& world = parallel.world();
  if (world.rank() == 0) {
    fs::remove_all(temp);
    fs::create_directories(temp);
  }
  world.barrier();
  // Under expert parallelism each rank of a stage's expert group writes its experts (the
  // caller leaves the rest to expert rank 0).
  const auto suffix_of = [&](int stage, int expert) {
    return "-pp" + std::to_string(stage) +
           (parallel.expert_size() > 1 ? "-ep" + std::to_string(expert) : std::string()) +
           ".safetensors";
  };
  const std::string suffix = suffix_of(parallel.pipeline_rank(), parallel.expert_rank());
  // Every rank learns whether every write succeeded, so a full disk on one stage's rank
  // ends all of them with the same error instead of leaving the others at a barrier.
  std::string error;
  if (parallel.tensor_rank() == 0 && parallel.expert_data_rank() == 0) {
    try {
      save_safetensors((temp / ("model" + suffix)).string(), part.model);
      save_safetensors((temp / ("optimizer" + suffix)).string(), part.optimizer);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  const auto agree = [&](const std::string& stage) {
    const double failed = world.all_reduce(error.empty() ? 0.0 : 1.0, ReduceOp::Max);
    if (failed == 0) return;
    if (world.rank() == 0) {
      std::error_code ignored;
      fs::remove_all(temp, ignored);
    }
    fail(detail::concat("checkpoint '", dir, "' not saved (", stage,
                        "): ", error.empty() ? "another rank's write failed" : error,
                        "; the previous checkpoint there (if any) is intact"));
  };
  agree("tensor files");
  if (world.rank() == 0) {
    try {
      nlohmann::json trainer = part.trainer;
      std::vector<std::string> files;
      nlohmann::json model = nlohmann::json::array(), optimizer = nlohmann::json::array();
      for (int s = 0; s < parallel.pipeline_size(); ++s) {
        for (int e = 0; e < parallel.expert_size(); ++e) {
          model.push_back("model" + suffix_of(s, e));
          optimizer.push_back("optimizer" + suffix_of(s, e));
          files.push_back(model.back().get<std::string>());
          files.push_back(optimizer.back().get<std::string>());
        }
      }
      trainer["shards"] = {{"model", model}, {"optimizer", optimizer}};
      trainer["layout"] = {{"tensor", parallel.tensor_size()},
                           {"pipeline", parallel.pipeline_size()},
                           {"expert", parallel.expert_size()},
                           {"data", parallel.data_size()}};
      for (const auto& [name, source] : part.files) {
        copy_into(temp, name, source);
        files.push_back(name);
      }
      trainer["files"] = file_digests(temp, files);
      write_json(temp / "trainer.json", trainer);
      swap_in(temp, target);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  agree("trainer.json");  // and nobody reads the directory before it is complete
}

Checkpoint load_checkpoint(const std::string& dir) {
  const fs::path root(dir);
  OCTET_CHECK(fs::is_directory(root), "checkpoint '", dir,
              "' not found: expected a directory holding model.safetensors, "
              "optimizer.safetensors and trainer.json");
  OCTET_CHECK(fs::exists(root / "trainer.json"), "checkpoint '", dir,
              "' is incomplete: missing trainer.json");
  Checkpoint checkpoint;
  std::ifstream in(root / "trainer.json");
  checkpoint.trainer = nlohmann::json::parse(in, nullptr, false);
  OCTET_CHECK(!checkpoint.trainer.is_discarded() && checkpoint.trainer.is_object(), "checkpoint '",
              dir, "': trainer.json is not a JSON object (corrupt)");
  std::vector<std::string> model_files = {"model.safetensors"};
  std::vector<std::string> optimizer_files = {"optimizer.safetensors"};
  if (checkpoint.trainer.contains("shards")) {
    const nlohmann::json& shards = checkpoint.trainer["shards"];
    auto names = [&](const char* key) {
      OCTET_CHECK(shards.is_object() && shards.contains(key) && shards[key].is_array() &&
                      !shards[key].empty(),
                  "checkpoint '", dir, "': trainer.json 'shards' expected a non-empty '", key,
                  "' list, got ", shards.dump());
      std::vector<std::string> out;
      for (const auto& name : shards[key]) {
        // A plain name: not "", "." or ".." (directories) and within NAME_MAX, so that the
        // filesystem calls below cannot throw std::filesystem_error.
        OCTET_CHECK(
            name.is_string() && name.get<std::string>().find('/') == std::string::npos &&
                name != "" && name != "." && name != ".." && name.get<std::string>().size() <= 255,
            "checkpoint '", dir, "': shard names expected plain file names, got ", name.dump());
        out.push_back(name.get<std::string>());
      }
      return out;
    };
    model_files = names("model");
    optimizer_files = names("optimizer");
  }
  // Shards of one checkpoint hold disjoint tensors, except copies of one tensor (the tied
  // embedding on the first and last stage), which are equal: the first is kept.
  auto merge = [&](const std::vector<std::string>& files, TensorMap& into) {
    for (const std::string& file : files) {
      std::error_code error;
      OCTET_CHECK(fs::is_regular_file(root / file, error), "checkpoint '", dir,
                  "' is incomplete: missing ", file);
      for (auto& [name, tensor] : load_safetensors((root / file).string())) {
        into.emplace(name, tensor);
      }
    }
  };
  std::vector<std::string> all_files = model_files;
  all_files.insert(all_files.end(), optimizer_files.begin(), optimizer_files.end());
  verify_digests(dir, checkpoint.trainer, all_files);
  merge(model_files, checkpoint.model);
  merge(optimizer_files, checkpoint.optimizer);
  return checkpoint;
}

MetricsWriter::MetricsWriter(const std::string& path) : path_(path) {
  if (path_.empty()) return;
  std::ofstream out(path_, std::ios::trunc);
  OCTET_CHECK(out.good(), "metrics: cannot open '", path_, "' for writing");
}

void MetricsWriter::write(const nlohmann::json& record) {
  if (path_.empty()) return;
  std::ofstream out(path_, std::ios::app);
  out << record.dump() << "\n";
}

namespace {

constexpr const char* kOptimizerSuffixes[] = {".exp_avg", ".exp_avg_sq"};

}  // namespace

TensorMap shard_optimizer_state(TrainableModel& model, const std::vector<Parameter*>& trained,
                                TensorMap whole, const std::string& source) {
  for (Parameter* p : trained) {
    for (const char* suffix : kOptimizerSuffixes) {
      auto it = whole.find(p->name + suffix);
      OCTET_CHECK(it != whole.end(), "checkpoint '", source, "': optimizer state misses '",
                  p->name + suffix, "'");
      it->second = model.shard(*p, it->second);
    }
  }
  return whole;
}

TensorMap gather_optimizer_state(TrainableModel& model, const std::vector<Parameter*>& trained,
                                 const TensorMap& local) {
  TensorMap whole;
  for (Parameter* p : trained) {
    for (const char* suffix : kOptimizerSuffixes) {
      auto it = local.find(p->name + suffix);
      OCTET_CHECK(it != local.end(), "optimizer state: no '", p->name + suffix, "' to save");
      whole[p->name + suffix] = model.gather(*p, it->second);
    }
  }
  return whole;
}

}  // namespace octet
