/* ptxas_log.h - for the NVRTC tests: read ptxas -v reports out of an NVRTC log. */
#ifndef KVA_PTXAS_LOG_H
#define KVA_PTXAS_LOG_H

#include <stdlib.h>
#include <string.h>

/* The largest N of "N <what>" in log (e.g. what = "bytes spill stores"); 0 when there is none. */
static inline int kva__ptxas_max_count(const char* log, const char* what) {
    int best = 0;
    const size_t wl = strlen(what);
    for (const char* p = log; (p = strstr(p, what)) != NULL; p += wl) {
        const char* q = p;
        while (q > log && q[-1] == ' ') --q;
        while (q > log && q[-1] >= '0' && q[-1] <= '9') --q;
        const int v = atoi(q);
        if (v > best) best = v;
    }
    return best;
}

#endif
