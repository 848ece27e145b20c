/* cpu_variant.c - user variants on the CPU backend: the hook source, with the host prelude and exported row-wise
 * wrappers, is compiled by a C compiler found at run time ($KVA_CC, else cc, gcc or clang on PATH) into a shared
 * object in the JIT cache directory (file name = hash of the identity: source, options, compiler, library
 * version, host architecture; written to a temporary name and renamed, so a present entry is complete) and
 * loaded with dlopen. A cache entry is the object followed by the exact text it was compiled from and a footer
 * (sizes, hashes): on a hit the whole entry is read and checked (footer, object hash, text byte for byte) before
 * anything is loaded, so a truncated, corrupted or foreign entry (or another text with a colliding hash) is
 * compiled again instead of being mapped into the process. The checked bytes are loaded from a private copy
 * (written, dlopen'ed, unlinked; in a private temporary directory when the cache is read-only), so what runs is
 * what was checked and two live variants never share a handle through a path. Without a usable (or, on a miss,
 * writable) cache directory the object is built in a private temporary directory and removed once loaded. The
 * compiler's output goes to a log file whose text an error carries; nothing is printed. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cpu_internal.h"

extern char** environ;

#define KVA__CC_OPTS "-O2 -fPIC -shared -fvisibility=hidden -Werror=implicit-function-declaration -Wl,-z,defs"

/* the footer of a cache entry: [object][text][footer] */
#define KVA__VX_MAGIC "KVAVXSO1"
typedef struct kva__vx_footer {
    char magic[8];
    uint64_t obj_bytes, text_bytes, obj_hash, text_hash;
} kva__vx_footer;
#define KVA__VX_MAX_ENTRY ((size_t)1 << 30)

/* Full path of an executable: name with a '/' as is, else searched on PATH. */
static int kva__find_exe(const char* name, char* out, size_t size) {
    if (!name || !*name) return 0;
    if (strchr(name, '/')) {
        struct stat sb;
        if (stat(name, &sb) != 0 || !S_ISREG(sb.st_mode) || access(name, X_OK) != 0) return 0;
        snprintf(out, size, "%s", name);
        return 1;
    }
    const char* path = getenv("PATH");
    if (!path || !*path) path = "/usr/local/bin:/usr/bin:/bin";
    const char* p = path;
    while (*p) {
        const char* e = strchr(p, ':');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        if (n > 0 && n + strlen(name) + 2 < size) {
            char cand[PATH_MAX];
            snprintf(cand, sizeof cand, "%.*s/%s", (int)n, p, name);
            struct stat sb;
            if (stat(cand, &sb) == 0 && S_ISREG(sb.st_mode) && access(cand, X_OK) == 0) {
                snprintf(out, size, "%s", cand);
                return 1;
            }
        }
        if (!e) break;
        p = e + 1;
    }
    return 0;
}

/* The compiler: $KVA_CC (a program name or path, no arguments), else cc, gcc, clang. */
static kva_status kva__find_cc(char* out, size_t size) {
    const char* env = getenv("KVA_CC");
    if (env && *env) {
        KVA_RETURN_IF(!kva__find_exe(env, out, size), KVA_ERR_UNSUPPORTED,
                      "kva_variant_create: $KVA_CC = \"%s\" is not an executable (a program name on PATH or a path)",
                      env);
        return KVA_OK;
    }
    static const char* const names[] = {"cc", "gcc", "clang"};
    for (int i = 0; i < 3; ++i)
        if (kva__find_exe(names[i], out, size)) return KVA_OK;
    return kva__set_error(KVA_ERR_UNSUPPORTED,
                          "kva_variant_create: the CPU backend compiles variants with a C compiler, and none was found "
                          "($KVA_CC unset; no cc, gcc or clang on PATH)");
}

/* Growable text */
typedef struct kva__text {
    char* p;
    size_t n, cap;
    int oom;
} kva__text;

static void kva__text_add(kva__text* t, const char* s) {
    size_t k = strlen(s);
    if (t->oom) return;
    if (t->n + k + 1 > t->cap) {
        size_t cap = (t->n + k + 1) * 2;
        char* np = (char*)realloc(t->p, cap);
        if (!np) {
            t->oom = 1;
            return;
        }
        t->p = np;
        t->cap = cap;
    }
    memcpy(t->p + t->n, s, k + 1);
    t->n += k;
}

/* The compiled text without its identity line: prelude, the hooks (with #line so diagnostics name the user's
   lines), and the exported row functions of the hooks the spec declares. */
static void kva__cpu_variant_text(const kva_variant* v, kva__text* t) {
    char line[256];
    kva__text_add(t, kva__variant_prelude(0));
    snprintf(line, sizeof line, "#line 1 \"%s.hooks.c\"\n", v->name);
    kva__text_add(t, line);
    kva__text_add(t, v->source);
    kva__text_add(t, "\n#line 1 \"kvattn-variant-wrappers.c\"\n"
                     "#define KVA__VX __attribute__((visibility(\"default\")))\n");
    if (v->hooks & KVA_VARIANT_QUERY_TRANSFORM)
        kva__text_add(t, "KVA__VX void kva_vx_query_row(const kva_vparams* p, float* x, int n, int batch, int qo_head, "
                         "int q_pos) {\n"
                         "    for (int d = 0; d < n; ++d) x[d] = kva_query_transform(p, x[d], batch, qo_head, q_pos, d);\n"
                         "}\n");
    if (v->hooks & KVA_VARIANT_KEY_TRANSFORM)
        kva__text_add(t, "KVA__VX void kva_vx_key_row(const kva_vparams* p, float* x, int n, int batch, int kv_head, "
                         "int kv_pos) {\n"
                         "    for (int d = 0; d < n; ++d) x[d] = kva_key_transform(p, x[d], batch, kv_head, kv_pos, d);\n"
                         "}\n");
    if ((v->hooks & (KVA_VARIANT_LOGITS_TRANSFORM | KVA_VARIANT_LOGITS_MASK)) || !v->use_softmax) {
        kva__text_add(t, "KVA__VX int kva_vx_logits_row(const kva_vparams* p, float* s, int nt, int batch, int qo_head, "
                         "int kv_head, int q_pos, int kv_pos0) {\n"
                         "    int masked = 0;\n"
                         "    for (int i = 0; i < nt; ++i) {\n"
                         "        float x = s[i];\n"
                         "        int vis = x != -KVA_INFINITY;\n");
        if (v->hooks & KVA_VARIANT_LOGITS_MASK)
            kva__text_add(t, "        if (vis && !kva_logits_mask(p, batch, qo_head, kv_head, q_pos, kv_pos0 + i)) {\n"
                             "            vis = 0;\n"
                             "            masked = 1;\n"
                             "        }\n");
        if (v->hooks & KVA_VARIANT_LOGITS_TRANSFORM)
            kva__text_add(t, "        if (vis) x = kva_logits_transform(p, x, batch, qo_head, kv_head, q_pos, kv_pos0 + i);\n");
        kva__text_add(t, v->use_softmax ? "        s[i] = vis ? x : -KVA_INFINITY;\n" : "        s[i] = vis ? x : 0.0f;\n");
        kva__text_add(t, "    }\n"
                         "    return masked;\n"
                         "}\n");
    }
    if (v->hooks & KVA_VARIANT_OUTPUT_TRANSFORM)
        kva__text_add(t, "KVA__VX void kva_vx_output_row(const kva_vparams* p, float* x, int n, float lse, int batch, "
                         "int qo_head, int q_pos) {\n"
                         "    for (int d = 0; d < n; ++d) x[d] = kva_output_transform(p, x[d], lse, batch, qo_head, q_pos, d);\n"
                         "}\n");
}

/* The n bytes of data to a new file "<dir>/.<hash>.XXXXXX<suffix>" (kva__jit_write_unique). */
static int kva__write_unique(char* path, size_t size, const char* dir, const char* hash, const char* suffix,
                             const char* data, size_t n) {
    const void* parts[1] = {data};
    return kva__jit_write_unique(path, size, dir, hash, suffix, 1, parts, &n);
}

static char* kva__read_log(const char* path) {
    FILE* f = fopen(path, "rb");
    if (!f) return NULL;
    char* buf = (char*)malloc(6001);
    size_t n = buf ? fread(buf, 1, 6000, f) : 0;
    fclose(f);
    if (buf) buf[n] = '\0';
    return buf;
}

/* Run cc on src into out; *exit_code gets the exit status (-1: could not run, *spawn_err the reason). Output into
   log. */
static int kva__run_cc(const char* cc, const char* src, const char* out, const char* log, int* exit_code,
                       int* spawn_err) {
    posix_spawn_file_actions_t fa;
    *spawn_err = 0;
    if (posix_spawn_file_actions_init(&fa) != 0) return 0;
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    /* the options of KVA__CC_OPTS: a hook the spec declares but the source lacks fails here, with the log */
    char* argv[] = {(char*)cc, "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Werror=implicit-function-declaration",
                    "-Wl,-z,defs", "-o", (char*)out, (char*)src, "-lm", NULL};
    pid_t pid;
    int rc = posix_spawn(&pid, cc, &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) {
        *exit_code = -1;
        *spawn_err = rc;
        return 0;
    }
    int status = 0;
    pid_t w;
    do {
        w = waitpid(pid, &status, 0);
    } while (w < 0 && errno == EINTR);
    if (w < 0) { /* SIGCHLD ignored by the application: the child was reaped; judge by the output file */
        *exit_code = access(out, R_OK) == 0 ? 0 : -1;
        return 1;
    }
    *exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    return 1;
}

/* The whole of a regular file (at most max bytes; not through a symlink); NULL on any failure. */
static unsigned char* kva__read_file(const char* path, size_t max, size_t* n) {
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return NULL;
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size < 0 || (uint64_t)sb.st_size > (uint64_t)max) {
        close(fd);
        return NULL;
    }
    size_t sz = (size_t)sb.st_size, off = 0;
    unsigned char* buf = (unsigned char*)malloc(sz ? sz : 1);
    while (buf && off < sz) {
        ssize_t r = read(fd, buf + off, sz - off);
        if (r <= 0) {
            free(buf);
            buf = NULL;
        } else {
            off += (size_t)r;
        }
    }
    close(fd);
    if (buf) *n = sz;
    return buf;
}

/* A cache entry [object][text][footer] compiled from exactly `text`: its object's size, else 0. */
static size_t kva__entry_check(const unsigned char* b, size_t n, const char* text, size_t tn) {
    kva__vx_footer f;
    if (n < sizeof f) return 0;
    memcpy(&f, b + n - sizeof f, sizeof f);
    if (memcmp(f.magic, KVA__VX_MAGIC, sizeof f.magic) != 0) return 0;
    const uint64_t body = (uint64_t)(n - sizeof f);
    if (f.text_bytes != (uint64_t)tn || f.obj_bytes > body || f.text_bytes != body - f.obj_bytes) return 0;
    if (f.obj_bytes < 4 || memcmp(b, "\177ELF", 4) != 0) return 0;
    if (memcmp(b + f.obj_bytes, text, tn) != 0) return 0;
    if (kva__fnv(KVA__FNV_SEED, b, (size_t)f.obj_bytes) != f.obj_hash) return 0;
    if (kva__fnv(KVA__FNV_SEED, text, tn) != f.text_hash) return 0;
    return (size_t)f.obj_bytes;
}

/* Appends [text][footer] to the compiled object at path (its n bytes in obj) and makes it 0600. */
static int kva__entry_seal(const char* path, const unsigned char* obj, size_t n, const char* text, size_t tn) {
    kva__vx_footer f;
    memset(&f, 0, sizeof f);
    memcpy(f.magic, KVA__VX_MAGIC, sizeof f.magic);
    f.obj_bytes = n;
    f.text_bytes = tn;
    f.obj_hash = kva__fnv(KVA__FNV_SEED, obj, n);
    f.text_hash = kva__fnv(KVA__FNV_SEED, text, tn);
    int fd = open(path, O_WRONLY | O_APPEND | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return 0;
    int ok = fchmod(fd, 0600) == 0 && kva__jit_write_all(fd, text, tn) && kva__jit_write_all(fd, &f, sizeof f);
    if (close(fd) != 0) ok = 0;
    return ok;
}

/* A new private directory under $TMPDIR (else /tmp) into dir: 0, else -1 (the path does not fit) or the errno of
   mkdtemp. */
static int kva__private_dir(char* dir, size_t size) {
    const char* tmpd = getenv("TMPDIR");
    int k = snprintf(dir, size, "%s/kvattn-XXXXXX", tmpd && *tmpd ? tmpd : "/tmp");
    if (k < 0 || (size_t)k >= size) return -1;
    return mkdtemp(dir) ? 0 : errno;
}

static kva_status kva__cpu_variant_bind(kva_variant* v, void* dl, const char* ident);

/* Loads the n checked object bytes through a private file in dir (written, dlopen'ed, unlinked). */
static kva_status kva__load_object(kva_variant* v, const char* dir, const char* hash, const unsigned char* obj,
                                   size_t n, const char* ident) {
    char path[1200];
    if (!kva__write_unique(path, sizeof path, dir, hash, ".load.so", (const char*)obj, n))
        return kva__set_error(KVA_ERR_JIT, "kva_variant_create: cannot write %s (%s)", path, strerror(errno));
    void* dl = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    const char* err = dl ? NULL : dlerror();
    kva_status st = KVA_OK;
    if (!dl) st = kva__set_error(KVA_ERR_JIT, "kva_variant_create: dlopen of variant %s failed: %s", v->name,
                                 err ? err : "?");
    unlink(path); /* the mapping stays */
    if (st == KVA_OK) {
        st = kva__cpu_variant_bind(v, dl, ident);
        if (st != KVA_OK) dlclose(dl);
    }
    return st;
}

static kva_status kva__cpu_variant_bind(kva_variant* v, void* dl, const char* ident) {
    const char* got = (const char*)dlsym(dl, "kva_vx_ident");
    KVA_RETURN_IF(!got || strcmp(got, ident) != 0, KVA_ERR_JIT,
                  "variant %s: the shared object does not carry this variant's identity", v->name);
    v->cpu_query = NULL;
    v->cpu_key = NULL;
    v->cpu_logits = NULL;
    v->cpu_output = NULL;
    /* function pointers from dlsym: the POSIX way is a copy of the object pointer's bytes */
    void* s;
    if (v->hooks & KVA_VARIANT_QUERY_TRANSFORM) {
        s = dlsym(dl, "kva_vx_query_row");
        memcpy(&v->cpu_query, &s, sizeof s);
    }
    if (v->hooks & KVA_VARIANT_KEY_TRANSFORM) {
        s = dlsym(dl, "kva_vx_key_row");
        memcpy(&v->cpu_key, &s, sizeof s);
    }
    if ((v->hooks & (KVA_VARIANT_LOGITS_TRANSFORM | KVA_VARIANT_LOGITS_MASK)) || !v->use_softmax) {
        s = dlsym(dl, "kva_vx_logits_row");
        memcpy(&v->cpu_logits, &s, sizeof s);
        KVA_RETURN_IF(!s, KVA_ERR_JIT, "variant %s: kva_vx_logits_row missing from its shared object", v->name);
    }
    if (v->hooks & KVA_VARIANT_OUTPUT_TRANSFORM) {
        s = dlsym(dl, "kva_vx_output_row");
        memcpy(&v->cpu_output, &s, sizeof s);
    }
    KVA_RETURN_IF(((v->hooks & KVA_VARIANT_QUERY_TRANSFORM) && !v->cpu_query) ||
                      ((v->hooks & KVA_VARIANT_KEY_TRANSFORM) && !v->cpu_key) ||
                      ((v->hooks & KVA_VARIANT_OUTPUT_TRANSFORM) && !v->cpu_output),
                  KVA_ERR_JIT, "variant %s: a hook wrapper is missing from its shared object", v->name);
    v->dl = dl;
    return KVA_OK;
}

kva_status kva__cpu_variant_compile(kva_context* ctx, kva_variant* v) {
    char cc[PATH_MAX];
    KVA_FORWARD(kva__find_cc(cc, sizeof cc));
    char ccreal[PATH_MAX];
    if (!realpath(cc, ccreal)) snprintf(ccreal, sizeof ccreal, "%s", cc);
    struct stat csb;
    memset(&csb, 0, sizeof csb);
    stat(ccreal, &csb);
    struct utsname un;
    memset(&un, 0, sizeof un);
    uname(&un);

    kva__text t = {NULL, 0, 0, 0};
    kva__cpu_variant_text(v, &t);
    KVA_RETURN_IF(t.oom, KVA_ERR_OUT_OF_MEMORY, "kva_variant_create: out of host memory");
    /* identity: everything that decides the object's bytes (the compiler by path, size and modification time) */
    uint64_t hsrc = kva__fnv(KVA__FNV_SEED, t.p, t.n);
    char ident[PATH_MAX + 512];
    snprintf(ident, sizeof ident, "kvattn %s|cpu variant %s|cc %s %lld %lld|opts %s|arch %s|src %016llx",
             KVA_VERSION_STRING, v->name, ccreal, (long long)csb.st_size, (long long)csb.st_mtime, KVA__CC_OPTS,
             un.machine, (unsigned long long)hsrc);
    for (char* c = ident; *c; ++c)
        if (*c == '"' || *c == '\\' || (unsigned char)*c < 32) *c = '_';
    char hash[40];
    snprintf(hash, sizeof hash, "%016llx%016llx", (unsigned long long)kva__fnv(KVA__FNV_SEED, ident, strlen(ident)),
             (unsigned long long)kva__fnv(0x84222325cbf29ce4ull ^ 0x5bd1e995ull, ident, strlen(ident)));
    kva__text_add(&t, "KVA__VX const char kva_vx_ident[] = \"");
    kva__text_add(&t, ident);
    kva__text_add(&t, "\";\n");
    if (t.oom) {
        free(t.p);
        return kva__set_error(KVA_ERR_OUT_OF_MEMORY, "kva_variant_create: out of host memory");
    }

    char dir[1024];
    int cached = kva__jit_cache_dir(ctx->jit_cache_dir, dir, sizeof dir);
    const char* asked = ctx->jit_cache_dir[0] ? ctx->jit_cache_dir : getenv("KVATTN_CACHE_DIR");
    if (!cached && asked && *asked) /* a directory the caller named: say why it is not used */
        kva__log(ctx, KVA_LOG_WARN, "kvattn: cache directory %s is not used (it must be a directory of this user, "
                 "creatable, writable by the user alone); variant %s is compiled privately", asked, v->name);
    char final_so[1200];
    if (cached) {
        snprintf(final_so, sizeof final_so, "%s/%s.so", dir, hash);
        kva__error_save(); /* a cache entry that does not load is a miss, not this call's failure */
        size_t n = 0;
        struct stat esb;
        const int safe = kva__jit_file_safe(final_so);
        if (!safe && lstat(final_so, &esb) == 0)
            kva__log(ctx, KVA_LOG_WARN, "kvattn: cache entry %s is not a regular file of this user writable by it "
                     "alone; not loaded, compiling again", final_so);
        unsigned char* entry = safe ? kva__read_file(final_so, KVA__VX_MAX_ENTRY, &n) : NULL;
        size_t obj_n = entry ? kva__entry_check(entry, n, t.p, t.n) : 0;
        kva_status hit = KVA_ERR_JIT;
        if (obj_n > 0 && access(dir, W_OK | X_OK) == 0) {
            hit = kva__load_object(v, dir, hash, entry, obj_n, ident);
        } else if (obj_n > 0) { /* a read-only cache: the private copy goes to a private temporary directory */
            char pdir[1024];
            if (kva__private_dir(pdir, sizeof pdir) == 0) {
                hit = kva__load_object(v, pdir, hash, entry, obj_n, ident);
                rmdir(pdir);
            }
        }
        if (hit == KVA_OK) {
            free(entry);
            free(t.p);
            kva__log(ctx, KVA_LOG_DEBUG, "kvattn: variant %s from the cache %s", v->name, final_so);
            return KVA_OK;
        }
        if (entry && obj_n == 0)
            kva__log(ctx, KVA_LOG_WARN, "kvattn: cache entry %s is not this variant's complete object; compiling again",
                     final_so);
        free(entry);
        kva__error_restore();
        if (access(dir, W_OK | X_OK) != 0) cached = 0; /* readable, not writable: compile privately */
    }
    if (cached) kva__jit_sweep(ctx, dir, KVA__JIT_STALE_S); /* a miss: what compiles killed long ago left behind */
    if (kva__jit_disabled()) {
        free(t.p);
        return kva__set_error(KVA_ERR_UNSUPPORTED,
                              "kva_variant_create: variant %s is not in the JIT cache, and KVATTN_JIT=%s forbids "
                              "compiling it at run time", v->name, getenv("KVATTN_JIT"));
    }
    if (!cached) {
        int e = kva__private_dir(dir, sizeof dir);
        if (e != 0) {
            free(t.p);
            return kva__set_error(KVA_ERR_JIT, "kva_variant_create: no cache directory and no temporary directory "
                                               "(%s) for compiling variant %s",
                                  e < 0 ? "$TMPDIR too long" : strerror(e), v->name);
        }
    }
    kva__log(ctx, KVA_LOG_INFO, "kvattn: compiling variant %s with %s (cache %s)...", v->name, cc,
             cached ? dir : "disabled");
    /* the source's unique name ".<hash>.XXXXXX.c" is the stem of the object's and the log's while it exists */
    char src[1200], tmp_so[1200], log[1200];
    const int wrote = kva__write_unique(src, sizeof src, dir, hash, ".c", t.p, t.n);
    const int werr = errno;
    const int stem = wrote ? (int)strlen(src) - 2 : 0;
    snprintf(tmp_so, sizeof tmp_so, "%.*s.so.tmp", stem, src);
    snprintf(log, sizeof log, "%.*s.log", stem, src);
    kva_status st = KVA_OK;
    int code = -1, spawn_err = 0;
    unsigned char* obj = NULL;
    size_t obj_n = 0;
    if (!wrote) {
        st = kva__set_error(KVA_ERR_JIT, "kva_variant_create: cannot write %s (%s)", src, strerror(werr));
    } else if (!kva__run_cc(cc, src, tmp_so, log, &code, &spawn_err) || code != 0) {
        char* text = kva__read_log(log);
        st = kva__set_error(KVA_ERR_JIT, "kva_variant_create: compiling variant %s with %s failed (%s %d%s%s):\n%s",
                            v->name, cc, code < 0 ? "could not run, code" : "exit status", code,
                            spawn_err ? ": " : "", spawn_err ? strerror(spawn_err) : "",
                            text && *text ? text : "(no output)");
        free(text);
    } else if (!(obj = kva__read_file(tmp_so, KVA__VX_MAX_ENTRY, &obj_n)) || obj_n < 4) {
        st = kva__set_error(KVA_ERR_JIT, "kva_variant_create: cannot read the compiled object %s", tmp_so);
    } else if (cached) {
        /* into the cache: sealed with its text and footer, then renamed (a present entry is complete); a cache
           that refuses the entry only costs the next create a compile */
        if (!kva__entry_seal(tmp_so, obj, obj_n, t.p, t.n) || rename(tmp_so, final_so) != 0)
            kva__log(ctx, KVA_LOG_WARN, "kvattn: variant %s: could not store %s in the cache (%s)", v->name, final_so,
                     strerror(errno));
    }
    if (wrote) {
        unlink(src);
        unlink(log);
        unlink(tmp_so);
    }
    free(t.p);
    if (st == KVA_OK) st = kva__load_object(v, dir, hash, obj, obj_n, ident);
    free(obj);
    if (!cached) rmdir(dir); /* the object stays mapped after its file is removed */
    if (st != KVA_OK) kva__log(ctx, KVA_LOG_ERROR, "kvattn: %s", kva_last_error_message());
    return st;
}

void kva__cpu_variant_release(kva_context* ctx, kva_variant* v) {
    (void)ctx;
    if (v->dl) dlclose(v->dl);
    v->dl = NULL;
    v->cpu_query = NULL;
    v->cpu_key = NULL;
    v->cpu_logits = NULL;
    v->cpu_output = NULL;
}
