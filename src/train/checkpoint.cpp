// Checkpoint directories, written to DIR.tmp then swapped in with renames.
#include <filesystem>
#include <fstream>

#include "octet/train.h"

namespace octet {

namespace fs = std::filesystem;

void save_checkpoint(const std::string& dir, const Checkpoint& checkpoint) {
  const fs::path target(dir), temp(dir + ".tmp"), old(dir + ".old");
  fs::remove_all(temp);
  fs::create_directories(temp);
  save_safetensors((temp / "model.safetensors").string(), checkpoint.model);
  save_safetensors((temp / "optimizer.safetensors").string(), checkpoint.optimizer);
  {
    std::ofstream out(temp / "trainer.json");
    out << checkpoint.trainer.dump(2) << "\n";
    out.flush();
    OCTET_CHECK(out.good(), "save_checkpoint: cannot write ", (temp / "trainer.json").string());
  }
  // Swap: the previous checkpoint stays intact until the new one is complete.
  fs::remove_all(old);
  if (fs::exists(target)) fs::rename(target, old);
  fs::rename(temp, target);
  fs::remove_all(old);
}

Checkpoint load_checkpoint(const std::string& dir) {
  const fs::path root(dir);
  OCTET_CHECK(fs::is_directory(root), "checkpoint '", dir,
              "' not found: expected a directory holding model.safetensors, "
              "optimizer.safetensors and trainer.json");
  for (const char* part : {"model.safetensors", "optimizer.safetensors", "trainer.json"}) {
    OCTET_CHECK(fs::exists(root / part), "checkpoint '", dir, "' is incomplete: missing ", part);
  }
  Checkpoint checkpoint;
  checkpoint.model = load_safetensors((root / "model.safetensors").string());
  checkpoint.optimizer = load_safetensors((root / "optimizer.safetensors").string());
  std::ifstream in(root / "trainer.json");
  checkpoint.trainer = nlohmann::json::parse(in, nullptr, false);
  OCTET_CHECK(!checkpoint.trainer.is_discarded() && checkpoint.trainer.is_object(), "checkpoint '",
              dir, "': trainer.json is not a JSON object (corrupt)");
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

}  // namespace octet
