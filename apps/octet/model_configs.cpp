// Model configs by name: `--config gpt-mini` finds configs/gpt-mini.json installed beside the
// binary (PREFIX/share/octet/configs) or in the source tree it was built from; a path is
// taken as it is.
#include <filesystem>
#include <string>
#include <vector>

#include "commands.h"
#include "octet/error.h"

namespace octet::cli {

namespace {

std::vector<std::filesystem::path> config_dirs() {
  std::vector<std::filesystem::path> dirs;
  std::error_code error;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", error);
  if (!error) dirs.push_back(exe.parent_path().parent_path() / "share" / "octet" / "configs");
  dirs.push_back(std::filesystem::path(OCTET_SOURCE_DIR) / "configs");
  return dirs;
}

}  // namespace

std::filesystem::path resolve_config(const std::string& config) {
  if (std::filesystem::is_regular_file(config)) return config;
  std::string names, searched;
  for (const auto& dir : config_dirs()) {
    const auto named = dir / (config + ".json");
    if (std::filesystem::is_regular_file(named)) return named;
    searched += (searched.empty() ? "" : ", ") + dir.string();
    std::error_code error;
    for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
      if (entry.path().extension() != ".json") continue;
      const std::string name = entry.path().stem().string();
      if (names.find(name) == std::string::npos) names += (names.empty() ? "" : ", ") + name;
    }
  }
  fail(detail::concat("--config expected a config file or the name of one (", names, "; searched ",
                      searched, "), got '", config, "'"));
}

CLI::Validator model_config_validator() {
  return CLI::Validator(
      [](std::string& value) {
        try {
          value = resolve_config(value).string();
          return std::string();
        } catch (const Error& e) {
          return std::string(e.what());
        }
      },
      "CONFIG", "model config");
}

}  // namespace octet::cli
