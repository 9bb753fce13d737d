// SPDX-License-Identifier: Apache-2.0
// A case that cannot get what it needs (memory, a device feature, a privilege) says so instead
// of passing without checking:
//
//   if (free_bytes < needed) { return wm_test::skip("needs 9 GiB of GPU memory, 3 free"); }
//
// skip() prints "SKIPPED: <case>: <reason>" and records the skip; the case then returns. The
// program's exit code is 77 (ctest's SKIP_RETURN_CODE: the entry reports "skipped") when a case
// skipped and none failed; a failure anywhere still fails the run. The record is shared by the
// ranks of a --ranks run (they are forked from main), so a skip on any rank counts.
#pragma once

#include <string>

namespace wm_test {

/// Records that the running case skipped its checks for @p reason (see above).
void skip(std::string const& reason);

/// True once some case of this run (any rank) called skip().
[[nodiscard]] bool skipped() noexcept;

}  // namespace wm_test
