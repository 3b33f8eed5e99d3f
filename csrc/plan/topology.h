// Topology model: which devices of one host are joined by direct links.
//
// Pure C++17, no torch or CUDA. A LinkMatrix counts direct links (NVLinks, or
// 1 for "peer reachable") between every ordered pair of devices; the plans only
// ask "is there a direct link between a and b" and "how is the host wired".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace xdev::plan {

// How the devices of one host are connected, coarsest first.
enum class TopologyClass {
  kNone,            // no direct links at all (e.g. PCIe without peer access)
  kPartial,         // some pairs linked, not DGX-1-like, not fully connected
  kFullyConnected,  // every pair linked
  kDgx1,            // exactly the DGX-1 hybrid cube-mesh of 8 GPUs
  kNvSwitch,        // every GPU has NVLinks to NVSwitches (HGX / DGX A100, H100)
};

const char* to_string(TopologyClass c);

class LinkMatrix {
 public:
  LinkMatrix() = default;
  explicit LinkMatrix(int num_devices);

  // Builds a matrix from adjacency lists; each entry of neighbors[i] is linked
  // to i with one link, in both directions.
  static LinkMatrix from_neighbors(const std::vector<std::vector<int>>& neighbors);

  // Every pair linked once; the CPU shared-memory transport looks like this.
  static LinkMatrix fully_connected(int num_devices);

  // The NVLink wiring of an 8-GPU DGX-1 (hybrid cube-mesh).
  static LinkMatrix dgx1();

  // From rows as a user, a file or a binding gives them: square, at most
  // kMaxMatrixDevices rows, symmetric, every entry off the diagonal in
  // 0..max_links; the diagonal is ignored (stored as 0). Throws
  // std::invalid_argument for the first problem, naming the matrix by `what`,
  // e.g. "the NVLink matrix has -1 at [0][1], expected 0..1024".
  static LinkMatrix from_rows(const std::vector<std::vector<int64_t>>& rows,
                              const std::string& what = "the link matrix",
                              int64_t max_links = kMaxLinksPerPair);
  std::vector<std::vector<int64_t>> to_rows() const;  // every entry, as stored

  // One line of text, "n v00 v01 ... v(n-1)(n-1)" (a Store value), and back;
  // from_text validates as from_rows does and throws std::invalid_argument on
  // malformed text.
  std::string to_text() const;
  static LinkMatrix from_text(const std::string& text, const std::string& what = "the link matrix");

  // More links than this between two devices is a corrupt input, not a machine.
  static constexpr int64_t kMaxLinksPerPair = 1024;
  static constexpr int64_t kMaxMatrixDevices = 4096;

  int size() const { return n_; }
  int links(int a, int b) const;
  void set_links(int a, int b, int count);  // symmetric
  bool linked(int a, int b) const { return a == b || links(a, b) > 0; }

  // Peer set of device i (excluding i itself), ascending.
  std::vector<int> neighbors(int i) const;

 private:
  int n_ = 0;
  std::vector<int> links_;  // n_ * n_, row-major
};

// The DGX-1 test: exactly 8 devices and each device's peer set
// equals its DGX-1 row (a device listing itself as well is allowed). Used on
// adjacency lists as a user or a topology file gives them.
bool is_dgx1_like(const std::vector<std::vector<int>>& neighbors);
bool is_dgx1_like(const LinkMatrix& m);

TopologyClass classify(const LinkMatrix& m);

// Classifies the GPUs of one host. Both matrices are indexed by local rank (two
// ranks may share one GPU). `nvlink` counts NVLinks per pair (0: none, or not
// known, e.g. without NVML), pairs joined through NVSwitches included;
// `reachable` is > 0 where the pair can access each other's memory (CUDA peer
// access, or the same GPU); `nvswitch`, when given, is per rank its GPU's
// NVLinks to NVSwitches. DGX-1 iff is_dgx1_like(nvlink), so reachability alone
// never makes a DGX-1; otherwise NVSwitch when more than one rank and every
// rank's GPU reaches a switch; otherwise fully connected if every pair is
// reachable or NVLinked, partial if some pair is, else none. No ranks at all
// is kNone (there is nothing to connect); one rank is kFullyConnected. Throws
// std::invalid_argument if the sizes differ.
TopologyClass classify_gpus(const LinkMatrix& nvlink, const LinkMatrix& reachable,
                            const std::vector<int>& nvswitch = {});

// The direct GPU-to-GPU links of `nvlink`, which counts a pair joined through
// NVSwitches with min(switch links of a, of b) on top of any direct links (as
// NVML reports them and topology files give them). Throws
// std::invalid_argument unless nvswitch is empty or one entry per rank.
LinkMatrix direct_links(const LinkMatrix& nvlink, const std::vector<int>& nvswitch);

// Reachability as the links imply it: 1 where nvlink has a link, and on the
// diagonal (a GPU reaches its own memory). For injected topologies that give
// no reachability matrix.
LinkMatrix reachable_from_links(const LinkMatrix& nvlink);

}  // namespace xdev::plan
