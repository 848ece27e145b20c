/* jit_cache.c - the on-disk cache directory shared by the run-time compilers (NVRTC kernels of the CUDA backend,
 * shared objects of user variants on the CPU backend) and the hash that keys its entries. */
#define _GNU_SOURCE /* mkostemps */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <dirent.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

uint64_t kva__fnv(uint64_t h, const void* data, size_t n) {
    const unsigned char* p = (const unsigned char*)data;
    for (size_t i = 0; i < n; ++i) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

static int kva__dir_safe(const char* path) {
    struct stat sb;
    if (stat(path, &sb) != 0) return 0;
    if (!S_ISDIR(sb.st_mode)) return 0;
    if (sb.st_uid != geteuid()) return 0;
    if (sb.st_mode & (S_IWGRP | S_IWOTH)) return 0;
    return 1;
}

int kva__jit_file_safe(const char* path) {
    struct stat sb;
    if (lstat(path, &sb) != 0) return 0;
    if (!S_ISREG(sb.st_mode)) return 0;
    if (sb.st_uid != geteuid()) return 0;
    if (sb.st_mode & (S_IWGRP | S_IWOTH)) return 0;
    return 1;
}

static int kva__mkdirs(const char* path) {
    char tmp[1024];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof tmp) return 0;
    memcpy(tmp, path, n + 1);
    for (size_t i = 1; i <= n; ++i) {
        if (tmp[i] == '/' || tmp[i] == '\0') {
            char c = tmp[i];
            tmp[i] = '\0';
            if (mkdir(tmp, 0700) != 0 && errno != EEXIST) return 0;
            tmp[i] = c;
        }
    }
    return 1;
}

/* The cache directory (created 0700 if missing): the configured path, else $KVATTN_CACHE_DIR, $XDG_CACHE_HOME/kvattn,
   $HOME/.cache/kvattn. 0 = no usable cache: none configured, a path too long (never cut short: a shorter path is
   another directory), not creatable, not a directory, not the caller's, or writable by others. */
int kva__jit_cache_dir(const char* configured, char* out, size_t size) {
    char path[1024];
    path[0] = '\0';
    const char* env;
    int n = 0;
    if (configured && *configured) n = snprintf(path, sizeof path, "%s", configured);
    else if ((env = getenv("KVATTN_CACHE_DIR")) && *env) n = snprintf(path, sizeof path, "%s", env);
    else if ((env = getenv("XDG_CACHE_HOME")) && *env) n = snprintf(path, sizeof path, "%s/kvattn", env);
    else if ((env = getenv("HOME")) && *env) n = snprintf(path, sizeof path, "%s/.cache/kvattn", env);
    if (!path[0] || n < 0 || (size_t)n >= sizeof path || (size_t)n >= size) return 0;
    if (!kva__mkdirs(path)) return 0;
    if (!kva__dir_safe(path)) return 0;
    snprintf(out, size, "%s", path);
    return 1;
}

int kva__jit_write_all(int fd, const void* data, size_t n) {
    const char* p = (const char*)data;
    size_t off = 0;
    while (off < n) {
        ssize_t w = write(fd, p + off, n - off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return 0;
        off += (size_t)w;
    }
    return 1;
}

int kva__jit_open_unique(char* path, size_t size, const char* dir, const char* hash, const char* suffix) {
    int k = snprintf(path, size, "%s/.%s.XXXXXX%s", dir, hash, suffix);
    if (k < 0 || (size_t)k >= size) {
        errno = ENAMETOOLONG;
        return -1;
    }
    return mkostemps(path, (int)strlen(suffix), O_CLOEXEC);
}

int kva__jit_write_unique(char* path, size_t size, const char* dir, const char* hash, const char* suffix, int nparts,
                          const void* const* parts, const size_t* lens) {
    int fd = kva__jit_open_unique(path, size, dir, hash, suffix);
    if (fd < 0) return 0;
    int ok = 1;
    for (int i = 0; i < nparts && ok; ++i) ok = kva__jit_write_all(fd, parts[i], lens[i]);
    if (close(fd) != 0) ok = 0;
    if (!ok) {
        int e = errno;
        unlink(path);
        errno = e;
    }
    return ok;
}

int kva__jit_publish(const char* dir, const char* hash, const char* final_path, int nparts, const void* const* parts,
                     const size_t* lens) {
    char tmp[1200];
    if (!kva__jit_write_unique(tmp, sizeof tmp, dir, hash, ".tmp", nparts, parts, lens)) return 0;
    if (rename(tmp, final_path) != 0) {
        int e = errno;
        unlink(tmp);
        errno = e;
        return 0;
    }
    return 1;
}

/* ".<32 hex digits>." then at least 4 more bytes: the temporary names of kva__jit_open_unique (and of earlier
   versions, ".<hash>.<pid>.<n>.<suffix>"); cache entries themselves ("<hash>.cubin", "<hash>.so") never start with '.' */
static int kva__jit_temp_name(const char* name) {
    if (name[0] != '.') return 0;
    for (int i = 1; i <= 32; ++i) {
        const char c = name[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return 0;
    }
    return name[33] == '.' && strlen(name) >= 38;
}

int kva__jit_sweep(const kva_context* ctx, const char* dir, long max_age_s) {
    DIR* d = opendir(dir);
    if (!d) return 0;
    const time_t now = time(NULL);
    int removed = 0;
    struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        if (!kva__jit_temp_name(e->d_name)) continue;
        char path[1400];
        if (snprintf(path, sizeof path, "%s/%s", dir, e->d_name) >= (int)sizeof path) continue;
        struct stat sb;
        if (lstat(path, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_uid != geteuid()) continue;
        if (now - sb.st_mtime < max_age_s) continue; /* another process may be writing it */
        if (unlink(path) == 0) ++removed;
    }
    closedir(d);
    if (removed > 0)
        kva__log(ctx, KVA_LOG_INFO, "kvattn: removed %d stale temporary file%s from the JIT cache %s", removed,
                 removed == 1 ? "" : "s", dir);
    return removed;
}

int kva__jit_disabled(void) {
    const char* e = getenv("KVATTN_JIT");
    return e && (strcmp(e, "0") == 0 || strcmp(e, "off") == 0 || strcmp(e, "OFF") == 0 || strcmp(e, "no") == 0 ||
                 strcmp(e, "false") == 0);
}
