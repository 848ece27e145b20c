/* cpu_pool.c - persistent thread pool of the CPU backend.
 *
 * num_threads - 1 pthreads are created at init; the calling thread acts as thread 0 of every job.
 * A job is published by bumping a generation counter; workers spin briefly on it (cheap back-to-back
 * calls, e.g. one run per layer) and then sleep on a condition variable. Completion is an atomic
 * countdown; the caller spins briefly, then sleeps. Nothing is allocated per job.
 * In the child of a fork() (which has none of the workers) the pool runs every job on the calling thread and its
 * destruction only frees memory (the workers' mutex and condition variables are the parent's). */
#include <stdlib.h>
#include <unistd.h>

#include "cpu_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVA_CPU_RELAX() _mm_pause()
#else
#define KVA_CPU_RELAX() ((void)0)
#endif

#define KVA__POOL_SPIN 2000

typedef struct kva__cpu_worker {
    struct kva__cpu_pool* pool;
    int tid;
} kva__cpu_worker;

struct kva__cpu_pool {
    int num_threads;
    int num_started;
    pid_t pid; /* the process whose threads these are */
    pthread_t* threads;
    kva__cpu_worker* workers;
    pthread_mutex_t mu;
    pthread_cond_t cv_start;
    pthread_cond_t cv_done;
    atomic_uint_fast64_t gen;
    atomic_int pending;
    atomic_int stop;
    /* current job (written before gen is bumped) */
    kva__cpu_job_fn fn;
    void* arg;
    int job_threads;
};

static void* worker_main(void* p) {
    kva__cpu_worker* w = (kva__cpu_worker*)p;
    kva__cpu_pool* pool = w->pool;
    uint_fast64_t seen = 0;
    for (;;) {
        uint_fast64_t g = atomic_load_explicit(&pool->gen, memory_order_acquire);
        for (int spin = 0; g == seen && spin < KVA__POOL_SPIN; ++spin) {
            KVA_CPU_RELAX();
            g = atomic_load_explicit(&pool->gen, memory_order_acquire);
        }
        if (g == seen) {
            pthread_mutex_lock(&pool->mu);
            while ((g = atomic_load_explicit(&pool->gen, memory_order_acquire)) == seen) pthread_cond_wait(&pool->cv_start, &pool->mu);
            pthread_mutex_unlock(&pool->mu);
        }
        seen = g;
        if (atomic_load_explicit(&pool->stop, memory_order_acquire)) break;
        if (w->tid < pool->job_threads) pool->fn(pool->arg, w->tid);
        if (atomic_fetch_sub_explicit(&pool->pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&pool->mu);
            pthread_cond_broadcast(&pool->cv_done);
            pthread_mutex_unlock(&pool->mu);
        }
    }
    return NULL;
}

kva_status kva__cpu_pool_create(int32_t num_threads, kva__cpu_pool** out) {
    *out = NULL;
    if (num_threads < 1) num_threads = 1;
    kva__cpu_pool* pool = (kva__cpu_pool*)calloc(1, sizeof(*pool));
    if (!pool) return kva__set_error(KVA_ERR_OUT_OF_MEMORY, "CPU backend: cannot allocate the thread pool");
    pool->num_threads = num_threads;
    pool->pid = getpid();
    atomic_init(&pool->gen, 0);
    atomic_init(&pool->pending, 0);
    atomic_init(&pool->stop, 0);
    if (pthread_mutex_init(&pool->mu, NULL) != 0) {
        free(pool);
        return kva__set_error(KVA_ERR_OUT_OF_MEMORY, "CPU backend: pthread_mutex_init failed");
    }
    if (pthread_cond_init(&pool->cv_start, NULL) != 0) {
        pthread_mutex_destroy(&pool->mu);
        free(pool);
        return kva__set_error(KVA_ERR_OUT_OF_MEMORY, "CPU backend: pthread_cond_init failed");
    }
    if (pthread_cond_init(&pool->cv_done, NULL) != 0) {
        pthread_cond_destroy(&pool->cv_start);
        pthread_mutex_destroy(&pool->mu);
        free(pool);
        return kva__set_error(KVA_ERR_OUT_OF_MEMORY, "CPU backend: pthread_cond_init failed");
    }
    if (num_threads > 1) {
        pool->threads = (pthread_t*)calloc((size_t)num_threads, sizeof(pthread_t));
        pool->workers = (kva__cpu_worker*)calloc((size_t)num_threads, sizeof(kva__cpu_worker));
        if (!pool->threads || !pool->workers) {
            kva__cpu_pool_destroy(pool);
            return kva__set_error(KVA_ERR_OUT_OF_MEMORY, "CPU backend: cannot allocate %d thread handles",
                                  num_threads);
        }
        for (int t = 1; t < num_threads; ++t) {
            pool->workers[t].pool = pool;
            pool->workers[t].tid = t;
            int rc = pthread_create(&pool->threads[t], NULL, worker_main, &pool->workers[t]);
            if (rc != 0) {
                kva__cpu_pool_destroy(pool);
                return kva__set_error(KVA_ERR_OUT_OF_MEMORY,
                                      "CPU backend: cannot create worker thread %d of %d (pthread_create error %d)",
                                      t, num_threads, rc);
            }
            pool->num_started = t;
        }
    }
    *out = pool;
    return KVA_OK;
}

void kva__cpu_pool_destroy(kva__cpu_pool* pool) {
    if (!pool) return;
    if (getpid() != pool->pid) { /* a fork's child: no workers to stop or join, and their waits are not ours */
        free(pool->threads);
        free(pool->workers);
        free(pool);
        return;
    }
    if (pool->num_started > 0) {
        pthread_mutex_lock(&pool->mu);
        atomic_store_explicit(&pool->stop, 1, memory_order_release);
        atomic_fetch_add_explicit(&pool->gen, 1, memory_order_acq_rel);
        pthread_cond_broadcast(&pool->cv_start);
        pthread_mutex_unlock(&pool->mu);
        for (int t = 1; t <= pool->num_started; ++t) pthread_join(pool->threads[t], NULL);
    }
    pthread_cond_destroy(&pool->cv_done);
    pthread_cond_destroy(&pool->cv_start);
    pthread_mutex_destroy(&pool->mu);
    free(pool->threads);
    free(pool->workers);
    free(pool);
}

void kva__cpu_pool_run(kva__cpu_pool* pool, int n, kva__cpu_job_fn fn, void* arg) {
    if (n > pool->num_threads) n = pool->num_threads;
    if (n <= 1 || pool->num_started < pool->num_threads - 1 || getpid() != pool->pid) {
        /* single thread (or a pool that could not start every thread, or a fork's child: run every tid here) */
        if (n <= 1) {
            fn(arg, 0);
        } else {
            for (int t = 0; t < n; ++t) fn(arg, t);
        }
        return;
    }
    int others = pool->num_threads - 1; /* every worker wakes; tids >= n return at once */
    pool->fn = fn;
    pool->arg = arg;
    pool->job_threads = n;
    atomic_store_explicit(&pool->pending, others, memory_order_relaxed);
    pthread_mutex_lock(&pool->mu);
    atomic_fetch_add_explicit(&pool->gen, 1, memory_order_acq_rel);
    pthread_cond_broadcast(&pool->cv_start);
    pthread_mutex_unlock(&pool->mu);

    fn(arg, 0);

    for (int spin = 0; spin < KVA__POOL_SPIN; ++spin) {
        if (atomic_load_explicit(&pool->pending, memory_order_acquire) == 0) return;
        KVA_CPU_RELAX();
    }
    pthread_mutex_lock(&pool->mu);
    while (atomic_load_explicit(&pool->pending, memory_order_acquire) != 0) pthread_cond_wait(&pool->cv_done, &pool->mu);
    pthread_mutex_unlock(&pool->mu);
}
