// `octet info`: what this processor offers and what octet will use.
#include <oneapi/dnnl/dnnl.hpp>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "octet/cpu_features.h"
#include "octet/gemm.h"
#include "octet/ops/attention.h"

namespace octet::cli {
namespace {

const char* onednn_isa_name(dnnl::cpu_isa isa) {
  switch (isa) {
    case dnnl::cpu_isa::sse41:
      return "sse41";
    case dnnl::cpu_isa::avx:
      return "avx";
    case dnnl::cpu_isa::avx2:
      return "avx2";
    case dnnl::cpu_isa::avx2_vnni:
      return "avx2_vnni";
    case dnnl::cpu_isa::avx512_core:
      return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx:
      return "avx512_core_amx";
    default:
      return "other";
  }
}

void print_info(bool as_json) {
  const CpuFeatures& f = cpu_features();
  const dnnl_version_t* version = dnnl_version();
  nlohmann::json info = {
      {"cpu", f.brand},
      {"avx2", f.avx2},
      {"fma", f.fma},
      {"f16c", f.f16c},
      {"avx512f", f.avx512f},
      {"avx512bw", f.avx512bw},
      {"avx512vl", f.avx512vl},
      {"avx512_bf16", f.avx512_bf16},
      {"amx_tile", f.amx_tile},
      {"amx_bf16", f.amx_bf16},
      {"kernel_isa", isa_name(active_isa())},
      {"avx512_unavailable", isa_unavailable_reason(Isa::Avx512)},
      {"onednn_version", std::to_string(version->major) + "." + std::to_string(version->minor) +
                             "." + std::to_string(version->patch)},
      {"onednn_isa", onednn_isa_name(dnnl::get_effective_cpu_isa())},
      {"bf16_gemm", gemm_bf16_native() ? "onednn bf16" : "widened to f32"},
      {"bf16_dot_rate_vs_fma", gemm_bf16_dot_rate()},
      {"bf16_attention_tiles",
       ops::cpu::flash_attention_bf16_tiles(ops::AttentionOptions{}, DType::BF16) ? "bf16 pairs"
                                                                                  : "f32"},
      {"threads", num_threads()},
  };
  if (as_json) {
    std::printf("%s\n", info.dump().c_str());
    return;
  }
  auto yes = [](bool value) { return value ? "yes" : "no"; };
  std::printf("cpu            %s\n", f.brand.c_str());
  std::printf("avx2 / fma     %s / %s\n", yes(f.avx2), yes(f.fma));
  std::printf("f16c           %s\n", yes(f.f16c));
  std::printf("avx512f/bw/vl  %s / %s / %s\n", yes(f.avx512f), yes(f.avx512bw), yes(f.avx512vl));
  std::printf("avx512_bf16    %s\n", yes(f.avx512_bf16));
  std::printf("amx tile/bf16  %s / %s\n", yes(f.amx_tile), yes(f.amx_bf16));
  std::printf("kernel isa     %s (octet's own kernels; OCTET_ISA=scalar|avx2|avx512 lowers it)\n",
              isa_name(active_isa()));
  for (Isa isa : {Isa::Avx512, Isa::Avx2}) {
    const std::string reason = isa_unavailable_reason(isa);
    if (!reason.empty())
      std::printf("               %s kernels unavailable: %s\n", isa_name(isa), reason.c_str());
  }
  std::printf("oneDNN         %s, isa %s\n", info["onednn_version"].get<std::string>().c_str(),
              info["onednn_isa"].get<std::string>().c_str());
  std::printf(
      "bf16 gemm      %s (VDPBF16PS flops/s %.2fx the F32 FMA's; below 0.75 without AMX, BF16\n"
      "               GEMMs run widened to F32; OCTET_GEMM_BF16=widen|native|auto)\n",
      info["bf16_gemm"].get<std::string>().c_str(), gemm_bf16_dot_rate());
  std::printf(
      "attention      %s tiles for BF16 inputs (bf16 pairs where VDPBF16PS does >= 0.75x the\n"
      "               FMA's flops; OCTET_ATTENTION_TILES=bf16|f32|auto)\n",
      info["bf16_attention_tiles"].get<std::string>().c_str());
  std::printf("threads        %d\n", num_threads());
}

}  // namespace

void register_info(CLI::App& app) {
  CLI::App* info = app.add_subcommand("info", "Processor features, oneDNN version, threads");
  auto as_json = std::make_shared<bool>(false);
  info->add_flag("--json", *as_json, "One JSON object instead of a table");
  info->callback([as_json] { print_info(*as_json); });
}

}  // namespace octet::cli
