// AMX's tile configuration and Linux's grant of the tile data, for the kernels that run AMX's tiles
// (kernels.cpp tile_blocks: bf16; kernels_avx2.cpp w4a8_tiles: int8).
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace rtk_amx {

struct alignas(64) TileConfig {  // ldtilecfg's palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux lets a process use AMX's tile data once it asks (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA;
// Documentation/arch/x86/xstate.rst); asked once, process-wide
inline bool tiles_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

}  // namespace rtk_amx
