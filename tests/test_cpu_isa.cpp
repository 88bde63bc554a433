// One CPU check and one override for every CPU kernel: MARKBASE_CPU_ISA (isa_from_env at the first
// call) or set_isa picks the table, and the fused dequantize-dot of the f32-activation path
// (cpu::vec_dot) follows it like the matmul and attention kernels do. A value the library cannot
// honour is an mb::Error that the CLI reports, never a printed warning.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backends/cpu/cpu_kernels.h"
#include "backends/cpu/qmatmul.h"
#include "core/error.h"
#include "core/quant.h"
#include "test_util.h"

namespace {

using mb::DType;
using mb::cpu::Isa;

constexpr Isa kAllIsas[] = {Isa::Scalar, Isa::Avx2, Isa::Avx512};

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// vec_dot of one row per type under `isa`, rows and activations fixed by the seed.
struct DotCase {
  DType t;
  std::vector<uint8_t> row;
  std::vector<float> x;
  double mag = 0;  // Σ|w·x|, the scale of the rounding differences
};

std::vector<DotCase> dot_cases() {
  std::vector<DotCase> cases;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  const DType types[] = {DType::F32, DType::F16,  DType::BF16, DType::Q8_0, DType::Q4_0, DType::Q4_1,
                         DType::Q5_0, DType::Q5_1, DType::Q4_K, DType::Q5_K, DType::Q6_K};
  for (DType t : types) {
    for (int64_t n : {int64_t(256), int64_t(2048)}) {
      DotCase c{t, std::vector<uint8_t>(mb::dtype_row_bytes(t, n)), std::vector<float>(size_t(n))};
      std::vector<float> w(static_cast<size_t>(n)), wd(static_cast<size_t>(n));
      for (auto& v : w) v = nd(rng);
      for (auto& v : c.x) v = nd(rng);
      mb::quantize_row(t, w.data(), c.row.data(), n);
      mb::dequantize_row(t, c.row.data(), wd.data(), n);
      for (int64_t i = 0; i < n; ++i) c.mag += std::fabs(double(wd[size_t(i)]) * c.x[size_t(i)]);
      cases.push_back(std::move(c));
    }
  }
  return cases;
}

}  // namespace

TEST(CpuIsa, VecDotFollowsTheActiveTable) {
  const std::vector<DotCase> cases = dot_cases();
  std::vector<uint32_t> simd;  // the first SIMD path's bits, case by case
  bool simd_differs_from_ref = false;
  for (Isa isa : kAllIsas) {
    if (!mb::cpu::kernels_for(isa)) continue;
    const Isa prev = mb::cpu::set_isa(isa);
    for (size_t i = 0; i < cases.size(); ++i) {
      const DotCase& c = cases[i];
      const int64_t n = int64_t(c.x.size());
      const float ref = mb::vec_dot_ref(c.t, c.row.data(), c.x.data(), n);
      const float got = mb::cpu::vec_dot(c.t, c.row.data(), c.x.data(), n);
      const std::string what = std::string(mb::cpu::isa_name(isa)) + " " + std::string(mb::dtype_name(c.t)) +
                               " n " + std::to_string(n);
      if (isa == Isa::Scalar) {
        // The scalar table's dot is the reference itself, bit for bit.
        EXPECT_EQ(bits(got), bits(ref)) << what;
        continue;
      }
      EXPECT_NEAR(got, ref, 2e-6 * c.mag) << what;
      if (bits(got) != bits(ref)) simd_differs_from_ref = true;
      // Both SIMD tables run the one AVX2 kernel.
      if (simd.size() < cases.size()) {
        simd.push_back(bits(got));
      } else {
        EXPECT_EQ(bits(got), simd[i]) << what;
      }
    }
    mb::cpu::set_isa(prev);
  }
  // The SIMD kernel sums in f32 in its own order, the reference in double: over these rows some
  // results differ in their last bits, which shows that switching the table switched the kernel.
  if (!simd.empty()) {
    EXPECT_TRUE(simd_differs_from_ref);
  }
}

TEST(CpuIsa, EnvValueNamesAPathTheCpuRunsOrIsAnError) {
  EXPECT_EQ(mb::cpu::isa_from_env(nullptr), mb::cpu::best_isa());
  EXPECT_EQ(mb::cpu::isa_from_env(""), mb::cpu::best_isa());
  EXPECT_EQ(mb::cpu::isa_from_env("scalar"), Isa::Scalar);
  EXPECT_EQ(mb::cpu::isa_from_env("Scalar"), Isa::Scalar);
  for (Isa isa : kAllIsas) {
    const char* name = mb::cpu::isa_name(isa);
    if (mb::cpu::kernels_for(isa)) {
      EXPECT_EQ(mb::cpu::isa_from_env(name), isa) << name;
      continue;
    }
    try {
      mb::cpu::isa_from_env(name);
      ADD_FAILURE() << name << " is not available here, yet accepted";
    } catch (const mb::Error& e) {
      EXPECT_NE(std::string(e.what()).find("cannot run the " + std::string(name) + " kernels"), std::string::npos)
          << e.what();
    }
  }
  for (const char* bad : {"avx-512", "sse4", "native", "avx2 "}) {
    try {
      mb::cpu::isa_from_env(bad);
      ADD_FAILURE() << "'" << bad << "' accepted";
    } catch (const mb::Error& e) {
      EXPECT_NE(std::string(e.what()).find("is not one of scalar, avx2, avx512"), std::string::npos) << e.what();
    }
  }
}

// The active table is the one MARKBASE_CPU_ISA asked for (the device run of
// tools/device/cpu_isa_suite.sh sets it per run), and AMX is off whenever MARKBASE_AMX=0.
TEST(CpuIsa, ActivePathsAreTheEnvironmentsChoice) {
  const Isa active = mb::cpu::kernels().isa;
  EXPECT_EQ(active, mb::cpu::isa_from_env(std::getenv("MARKBASE_CPU_ISA")));
  const char* amx_env = std::getenv("MARKBASE_AMX");
  const bool amx_int8 = mb::cpu::cpu_amx_int8_ready(), amx_bf16 = mb::cpu::cpu_amx_bf16_ready();
  if (amx_env && std::string(amx_env) == "0") {
    EXPECT_FALSE(amx_int8);
    EXPECT_FALSE(amx_bf16);
  }
  if (amx_int8) {
    EXPECT_TRUE(mb::cpu::cpu_has_avx512_vnni());
  }
  if (amx_int8 || amx_bf16) {
    EXPECT_NE(mb::cpu::kernels_for(Isa::Avx512), nullptr);
  }
  const mb::cpu::QMatmulFn q = mb::cpu::qmatmul_kernel();
  const char* integer = !q ? "none (f32 activations)"
                        : q == mb::cpu::qmatmul_amx()    ? "amx-int8"
                        : q == mb::cpu::qmatmul_avx512() ? "avx512-vnni"
                        : q == mb::cpu::qmatmul_avx2()   ? "avx2"
                                                         : "other";
  std::printf("[ figure ] active kernels: %s (best here: %s); integer matmul: %s; AMX-INT8 ready: %s; "
              "AMX-BF16 ready: %s; AMX-BF16 matmul active: %s\n",
              mb::cpu::isa_name(active), mb::cpu::isa_name(mb::cpu::best_isa()), integer, amx_int8 ? "yes" : "no",
              amx_bf16 ? "yes" : "no", mb::cpu::amx_bf16_matmul_active() ? "yes" : "no");
}

TEST(CpuIsa, CliRunsTheKernelsTheEnvironmentNamesAndRefusesOthers) {
  {
    mbtest::ScopedEnv env("MARKBASE_CPU_ISA", "scalar");
    const auto r = mbtest::run_cli("bench --synthetic tiny --pp 4 --tg 2 --reps 1 --json");
    EXPECT_EQ(r.exit_code, 0) << r.out;
    EXPECT_NE(r.out.find("\"isa\":\"scalar\""), std::string::npos) << r.out;
  }
  {
    mbtest::ScopedEnv env("MARKBASE_CPU_ISA", "avx-512");
    const auto r = mbtest::run_cli("bench --synthetic tiny --pp 4 --tg 2 --reps 1 --json");
    EXPECT_EQ(r.exit_code, 1) << r.out;
    EXPECT_NE(r.out.find("error: MARKBASE_CPU_ISA=avx-512 is not one of scalar, avx2, avx512"), std::string::npos)
        << r.out;
  }
}
