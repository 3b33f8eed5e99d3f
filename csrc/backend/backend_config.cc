#include "backend_config.h"

#include <stdexcept>
#include <string>

namespace xdev::backend {

void validate(const BackendConfig& config) {
  if (config.shm_slot_bytes < kMinSlotBytes) {
    throw std::invalid_argument("shm_slot_bytes must be >= " + std::to_string(kMinSlotBytes) +
                                "; got " + std::to_string(config.shm_slot_bytes));
  }
  if (config.cuda_slot_bytes < kMinSlotBytes || config.cuda_slot_bytes % kCudaSlotAlignment != 0) {
    throw std::invalid_argument("cuda_slot_bytes must be a multiple of " +
                                std::to_string(kCudaSlotAlignment) +
                                " and >= " + std::to_string(kMinSlotBytes) + "; got " +
                                std::to_string(config.cuda_slot_bytes));
  }
}

}  // namespace xdev::backend
