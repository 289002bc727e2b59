// Checkpoint directories, written to DIR.tmp then swapped in with renames.
#include <filesystem>
#include <fstream>

#include "octet/comm.h"
#include "octet/train.h"

namespace octet {

namespace fs = std::filesystem;

namespace {

void write_json(const fs::path& path, const nlohmann::json& json) {
  std::ofstream out(path);
  out << json.dump(2) << "\n";
  out.flush();
  OCTET_CHECK(out.good(), "save_checkpoint: cannot write ", path.string());
}

// The previous checkpoint stays intact until the new one is complete.
void swap_in(const fs::path& temp, const fs::path& target) {
  const fs::path old(target.string() + ".old");
  fs::remove_all(old);
  if (fs::exists(target)) fs::rename(target, old);
  fs::rename(temp, target);
  fs::remove_all(old);
}

}  // namespace

void save_checkpoint(const std::string& dir, const Checkpoint& checkpoint) {
  const fs::path target(dir), temp(dir + ".tmp");
  fs::remove_all(temp);
  fs::create_directories(temp);
  save_safetensors((temp / "model.safetensors").string(), checkpoint.model);
  save_safetensors((temp / "optimizer.safetensors").string(), checkpoint.optimizer);
  write_json(temp / "trainer.json", checkpoint.trainer);
  swap_in(temp, target);
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
  const std::string suffix = "-pp" + std::to_string(parallel.pipeline_rank()) + ".safetensors";
  if (parallel.tensor_rank() == 0 && parallel.data_rank() == 0) {
    save_safetensors((temp / ("model" + suffix)).string(), part.model);
    save_safetensors((temp / ("optimizer" + suffix)).string(), part.optimizer);
  }
  world.barrier();
  if (world.rank() == 0) {
    nlohmann::json trainer = part.trainer;
    nlohmann::json model = nlohmann::json::array(), optimizer = nlohmann::json::array();
    for (int s = 0; s < parallel.pipeline_size(); ++s) {
      model.push_back("model-pp" + std::to_string(s) + ".safetensors");
      optimizer.push_back("optimizer-pp" + std::to_string(s) + ".safetensors");
    }
    trainer["shards"] = {{"model", model}, {"optimizer", optimizer}};
    trainer["layout"] = {{"tensor", parallel.tensor_size()},
                         {"pipeline", parallel.pipeline_size()},
                         {"data", parallel.data_size()}};
    write_json(temp / "trainer.json", trainer);
    swap_in(temp, target);
  }
  world.barrier();  // nobody reads the directory before it is complete
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
        OCTET_CHECK(name.is_string() && name.get<std::string>().find('/') == std::string::npos,
                    "checkpoint '", dir, "': shard names expected plain file names, got ",
                    name.dump());
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
      OCTET_CHECK(fs::exists(root / file), "checkpoint '", dir, "' is incomplete: missing ", file);
      for (auto& [name, tensor] : load_safetensors((root / file).string())) {
        into.emplace(name, tensor);
      }
    }
  };
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

TensorMap shard_optimizer_state(TrainableModel& model, TensorMap whole, const std::string& source) {
  for (Parameter* p : model.parameters()) {
    for (const char* suffix : kOptimizerSuffixes) {
      auto it = whole.find(p->name + suffix);
      OCTET_CHECK(it != whole.end(), "checkpoint '", source, "': optimizer state misses '",
                  p->name + suffix, "'");
      it->second = model.shard(*p, it->second);
    }
  }
  return whole;
}

TensorMap gather_optimizer_state(TrainableModel& model, const TensorMap& local) {
  TensorMap whole;
  for (Parameter* p : model.parameters()) {
    for (const char* suffix : kOptimizerSuffixes) {
      auto it = local.find(p->name + suffix);
      OCTET_CHECK(it != local.end(), "optimizer state: no '", p->name + suffix, "' to save");
      whole[p->name + suffix] = model.gather(*p, it->second);
    }
  }
  return whole;
}

}  // namespace octet
