// A fake CUDA device for a CPU-only torch: the device guard and the hooks that autograd, autocast and fused
// optimizers ask for before they touch a "cuda" tensor, so that fake tensors (FakeTensorMode) on device "cuda" run
// the model's CUDA path through forward, backward and an optimizer step. Nothing here computes or allocates:
// isAvailable() stays false, and a real (non-fake) CUDA tensor still has no kernel to run.
// Loaded by tests/fake_cuda/__init__.py before ATen first asks for its CUDA hooks (they are cached on first use).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace at {
namespace {

// The registry key "CUDAHooks" is the one ATen looks up (at::detail::getCUDAHooks).
struct CUDAHooks : CUDAHooksInterface {
  explicit CUDAHooks(CUDAHooksArgs) {}
  void init() const override {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return false; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  int getNumGPUs() const override { return 1; }
  c10::DeviceIndex current_device() const override { return 0; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(c10::DeviceIndex) const override {}
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex) const override { return 0; }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex) const override { return 0; }
  void deviceSynchronize(c10::DeviceIndex) const override {}
};

}  // namespace

REGISTER_CUDA_HOOKS(CUDAHooks);

}  // namespace at

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
