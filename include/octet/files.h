// Files a run writes and reads back: output paths checked before any work is spent, and
// SHA-256 digests that make a flipped byte in a checkpoint a clear error instead of a
// silently different model.
#pragma once

#include <string>

namespace octet {

// An output file (metrics, plot, token shard ...): its directory exists or can be created and
// a file can be created in it; if the file exists it is a regular file. Throws octet::Error
// naming `what` (the flag, e.g. "--metrics") and the reason. Creates the missing directories,
// writes and removes a probe file, nothing else.
void check_writable_file(const std::string& path, const std::string& what);
// An output directory that is written as PATH.tmp and renamed over PATH (checkpoints): PATH is
// a directory or absent, and its parent can hold PATH.tmp. Same errors as above.
void check_writable_directory(const std::string& path, const std::string& what);

// fsync of a file or a directory (its entries), so what was written survives a power loss
// before a rename publishes it. Throws octet::Error naming the path.
void sync_to_disk(const std::string& path);

// Lower-case hex SHA-256 of a file's bytes (as `sha256sum` prints it). Throws octet::Error
// when the file cannot be read.
std::string sha256_file(const std::string& path);
// Of a byte string.
std::string sha256_hex(const void* data, size_t bytes);

}  // namespace octet
