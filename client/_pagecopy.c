/* Whole-page KV copies between an engine's CPU pool and radixd's mapped pool, in one call (optional: the engine
 * integrations fall back to numpy without it).
 *
 * An engine's scheduler thread runs each copy cache-cold: checking that the slots are whole pages in order and
 * copying them took some twenty numpy calls, whose dispatch cost more than the bytes. Here the check and every
 * buffer's page rows are one call.
 *
 * copy_pages(plan, src, dst, page, nogil=False, strided=False) -> bool
 *   plan: int64 buffer of (src_addr, src_pages, dst_addr, dst_pages, row_bytes) per buffer pair: a page row p
 *         of a buffer is row_bytes bytes at addr + p * row_bytes (the caller keeps the buffers alive); with
 *         strided, 7 per pair, (src_addr, src_pages, src_stride, dst_addr, dst_pages, dst_stride, row_bytes): row
 *         p at addr + p * stride (a page_first pool's buffer: its rows a whole page apart); threads > 1 (with
 *         nogil) splits the rows between that many threads (at most 8);
 *   src, dst: int64 slot vectors of the same length, whole pages in order (page p's slots p*page ... p*page +
 *         page - 1, the pages in any order);
 *   returns False, having copied nothing, unless both are whole pages within every buffer; with nogil, the
 *   bytes are copied with the GIL released (a background thread's copy).
 *
 * copy_kv_blocks(spec, blocks, pages, load) -> bool
 *   one layer's pages between a vLLM CPU block cache whose blocks are strided views of K and V (vLLM 0.32.0's
 *   vec kernels, as integrations/vllm/layout.py probed them) and radixd's K and V buffers [slots, heads, dim];
 *   spec: int64 buffer (kv_addr, num_blocks, k_addr, v_addr, radixd_pages, block_size, heads, head_dim,
 *         elem_size, heads_out, k_cols, v_cols, page_heads): a block is [heads][2][block_size * head_dim]
 *         (heads_out) or [2][heads][...], each kind's chunk row-major [token][dim] or column-major [dim][token]
 *         (k_cols, v_cols); radixd's slots hold page_heads >= heads heads, of which k_addr and v_addr point at the
 *         first of this engine's (a tensor-parallel rank copies its own heads of every slot);
 *   blocks, pages: int64 vectors of the same length, vLLM block i <-> radixd page i; load: radixd -> vLLM;
 *   returns False, having copied nothing, when an index is out of range.
 *
 * CopyQueue(): copy_kv_blocks jobs run in order on a native thread that never takes the GIL (see below). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

static int int64_vector(PyObject *o, Py_buffer *b, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_FORMAT | PyBUF_ND | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    const char *f = b->format ? b->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (b->ndim != 1 || b->itemsize != 8 || (strcmp(f, "q") && strcmp(f, "l"))) {
        PyErr_Format(PyExc_TypeError, "copy_pages: %s must be a 1-d native int64 vector (format '%s')", what,
                     b->format ? b->format : "B");
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* Three int64 vectors, held all or none. */
static int int64_vectors(PyObject *const objs[3], const char *const what[3], Py_buffer views[3]) {
    for (int i = 0; i < 3; i++)
        if (int64_vector(objs[i], &views[i], what[i]) < 0) {
            while (i--)
                PyBuffer_Release(&views[i]);
            return -1;
        }
    return 0;
}

static void release3(Py_buffer views[3]) {
    for (int i = 0; i < 3; i++)
        PyBuffer_Release(&views[i]);
}

/* The page numbers of whole pages in order (into out), or -1 if the slots are not, or a page is not below limit. */
static int whole_pages(const int64_t *s, Py_ssize_t n, int64_t page, int64_t limit, int64_t *out) {
    for (Py_ssize_t i = 0; i < n; i += page) {
        int64_t first = s[i];
        if (first < 0 || first % page || first / page >= limit)
            return -1;
        for (int64_t j = 1; j < page; j++)
            if (s[i + j] != first + j)
                return -1;
        out[i / page] = first / page;
    }
    return 0;
}

#define MAX_THREADS 8

/* A share of copy_pages' rows: (pair k, page i) for every index k * pages + i congruent to first mod step. */
typedef struct {
    const int64_t *plan;
    int w, sa, ss, da, ds, rb;
    Py_ssize_t pairs, pages;
    const int64_t *at, *to;
    int first, step;
} RowJob;

static void *row_job(void *arg) {
    const RowJob *j = arg;
    Py_ssize_t total = j->pairs * j->pages, per = (total + j->step - 1) / j->step;
    Py_ssize_t lo = per * j->first, hi = lo + per < total ? lo + per : total;  /* a contiguous block of rows */
    for (Py_ssize_t x = lo; x < hi; x++) {
        Py_ssize_t k = x / j->pages, i = x % j->pages;
        const int64_t *e = j->plan + j->w * k;
        memcpy((char *)(uintptr_t)e[j->da] + (size_t)j->to[i] * (size_t)e[j->ds],
               (const char *)(uintptr_t)e[j->sa] + (size_t)j->at[i] * (size_t)e[j->ss], (size_t)e[j->rb]);
    }
    return NULL;
}

static PyObject *copy_pages(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"plan", "src", "dst", "page", "nogil", "strided", "threads", NULL};
    PyObject *plan_o, *src_o, *dst_o;
    Py_ssize_t page, threads = 1;
    int nogil = 0, strided = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOn|ppn:copy_pages", names, &plan_o, &src_o, &dst_o, &page, &nogil,
                                     &strided, &threads))
        return NULL;
    if (threads > 1 && !nogil)
        threads = 1;  /* helper threads only where the caller let the GIL go */
    const int w = strided ? 7 : 5;  /* int64s per plan entry */
    const int sa = 0, sp = 1, ss = strided ? 2 : 4, da = strided ? 3 : 2, dp = strided ? 4 : 3,
              ds = strided ? 5 : 4, rb = strided ? 6 : 4;  /* where each field sits in an entry */
    if (page < 1)
        return PyErr_Format(PyExc_ValueError, "copy_pages: page must be >= 1, got %zd", page);
    Py_buffer v[3];
    if (int64_vectors((PyObject *const[]){plan_o, src_o, dst_o}, (const char *const[]){"plan", "src", "dst"}, v) < 0)
        return NULL;
    Py_buffer *plan = &v[0], *src = &v[1], *dst = &v[2];
    PyObject *result = NULL;
    int64_t *at = NULL;
    const int64_t *p = plan->buf;
    Py_ssize_t pairs = plan->shape[0] / w, n = src->shape[0], pages = n / page;
    if (plan->shape[0] % w) {
        PyErr_Format(PyExc_ValueError, "copy_pages: plan holds %d int64s per buffer pair", w);
        goto done;
    }
    if (dst->shape[0] != n || n % page || pairs == 0) {
        result = Py_False;
        goto done;
    }
    int64_t src_limit = INT64_MAX, dst_limit = INT64_MAX;
    for (Py_ssize_t k = 0; k < pairs; k++) {
        const int64_t *e = p + w * k;
        if (e[sa] == 0 || e[da] == 0 || e[sp] < 0 || e[dp] < 0 || e[rb] <= 0 || e[ss] < e[rb] || e[ds] < e[rb]) {
            PyErr_SetString(PyExc_ValueError, "copy_pages: a plan entry has a null address or a bad size");
            goto done;
        }
        src_limit = e[sp] < src_limit ? e[sp] : src_limit;
        dst_limit = e[dp] < dst_limit ? e[dp] : dst_limit;
    }
    at = PyMem_Malloc(sizeof(int64_t) * (2 * pages + 1));
    if (at == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *to = at + pages;
    if (whole_pages(src->buf, n, page, src_limit, at) < 0 || whole_pages(dst->buf, n, page, dst_limit, to) < 0) {
        result = Py_False;
        goto done;
    }
    PyThreadState *released = nogil ? PyEval_SaveThread() : NULL;
    RowJob jobs[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int nt = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : (int)threads, started = 0;
    if ((Py_ssize_t)nt > pairs * pages)
        nt = 1;
    for (int t = 0; t < nt; t++) {  /* thread t copies every nt-th row of the (pair, page) sequence */
        jobs[t] = (RowJob){p, w, sa, ss, da, ds, rb, pairs, pages, at, to, t, nt};
        if (t > 0 && pthread_create(&tids[t], NULL, row_job, &jobs[t]) == 0)
            started |= 1 << t;
    }
    row_job(&jobs[0]);
    for (int t = 1; t < nt; t++) {
        if (started & (1 << t))
            pthread_join(tids[t], NULL);
        else
            row_job(&jobs[t]);  /* (a thread that could not start: its rows here) */
    }
    if (released)
        PyEval_RestoreThread(released);
    result = Py_True;
done:
    PyMem_Free(at);
    release3(v);
    Py_XINCREF(result);
    return result;
}

/* One kind's chunk of a block (elements of T) <-> its page's slots: row-major runs of d, or a d x b transpose. */
#define CHUNK(T)                                                                                                     \
    do {                                                                                                             \
        T *c = (T *)chunk, *r = (T *)page;                                                                           \
        if (!cols) {                                                                                                 \
            for (int64_t t = 0; t < b; t++) {                                                                        \
                T *run = r + (t * rh + head) * d;                                                                    \
                if (load)                                                                                            \
                    memcpy(c + t * d, run, (size_t)d * sizeof(T));                                                   \
                else                                                                                                 \
                    memcpy(run, c + t * d, (size_t)d * sizeof(T));                                                   \
            }                                                                                                        \
        } else if (load) { /* token rows outer: a slot's row read whole (4.1 -> 6.7 GiB/s, 32 x 64 fp32) */       \
            for (int64_t t = 0; t < b; t++) {                                                                        \
                const T *run = r + (t * rh + head) * d;                                                              \
                for (int64_t j = 0; j < d; j++)                                                                      \
                    c[j * b + t] = run[j];                                                                           \
            }                                                                                                        \
        } else { /* a slot's row written whole (1.8 -> 8.0 GiB/s) */                                                 \
            for (int64_t t = 0; t < b; t++) {                                                                        \
                T *run = r + (t * rh + head) * d;                                                                    \
                for (int64_t j = 0; j < d; j++)                                                                      \
                    run[j] = c[j * b + t];                                                                           \
            }                                                                                                        \
        }                                                                                                            \
    } while (0)

/* A copy_kv_blocks spec and its index vectors checked: 1 fine, 0 an index out of range, -1 a bad spec (raised). */
static int kv_check(const int64_t *sp, Py_ssize_t spec_len, const int64_t *bi, const int64_t *pi, Py_ssize_t n,
                    Py_ssize_t n_pages) {
    if (spec_len != 13) {
        PyErr_SetString(PyExc_ValueError, "copy_kv_blocks: spec holds 13 int64s");
        return -1;
    }
    int64_t b = sp[5], h = sp[6], d = sp[7], es = sp[8], rh = sp[12];
    if (!sp[0] || !sp[2] || !sp[3] || b <= 0 || h <= 0 || d <= 0 || rh < h ||
        (es != 1 && es != 2 && es != 4 && es != 8)) {
        PyErr_SetString(PyExc_ValueError, "copy_kv_blocks: a null address or a bad geometry in spec");
        return -1;
    }
    if (n_pages != n)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (bi[i] < 0 || bi[i] >= sp[1] || pi[i] < 0 || pi[i] >= sp[4])
            return 0;
    return 1;
}

/* The copy itself (checked by kv_check; no Python object touched: it may run on a thread without the GIL). */
static void kv_copy(const int64_t *sp, const int64_t *bi, const int64_t *pi, Py_ssize_t n, int load) {
    char *kv = (char *)(uintptr_t)sp[0], *kb = (char *)(uintptr_t)sp[2], *vb = (char *)(uintptr_t)sp[3];
    int64_t b = sp[5], h = sp[6], d = sp[7], es = sp[8], rh = sp[12];
    int heads_out = sp[9] != 0, k_cols = sp[10] != 0, v_cols = sp[11] != 0;
    size_t chunk_bytes = (size_t)(b * d * es), block_bytes = 2 * (size_t)h * chunk_bytes;
    size_t page_bytes = (size_t)(b * rh * d * es);
    for (Py_ssize_t i = 0; i < n; i++) {
        char *block = kv + (size_t)bi[i] * block_bytes;
        for (int kind = 0; kind < 2; kind++) {
            char *page = (kind ? vb : kb) + (size_t)pi[i] * page_bytes;
            int cols = kind ? v_cols : k_cols;
            for (int64_t head = 0; head < h; head++) {
                char *chunk = block + (size_t)(heads_out ? head * 2 + kind : kind * h + head) * chunk_bytes;
                switch (es) {
                case 1: CHUNK(uint8_t); break;
                case 2: CHUNK(uint16_t); break;
                case 4: CHUNK(uint32_t); break;
                default: CHUNK(uint64_t); break;
                }
            }
        }
    }
}

static PyObject *copy_kv_blocks(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"spec", "blocks", "pages", "load", NULL};
    PyObject *spec_o, *blocks_o, *pages_o;
    int load;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOp:copy_kv_blocks", names, &spec_o, &blocks_o, &pages_o, &load))
        return NULL;
    Py_buffer v[3];
    if (int64_vectors((PyObject *const[]){spec_o, blocks_o, pages_o}, (const char *const[]){"spec", "blocks", "pages"},
                      v) < 0)
        return NULL;
    PyObject *result = NULL;
    const int64_t *sp = v[0].buf, *bi = v[1].buf, *pi = v[2].buf;
    Py_ssize_t n = v[1].shape[0];
    int ok = kv_check(sp, v[0].shape[0], bi, pi, n, v[2].shape[0]);
    if (ok > 0)
        kv_copy(sp, bi, pi, n, load);
    if (ok >= 0)
        result = ok ? Py_True : Py_False;
    release3(v);
    Py_XINCREF(result);
    return result;
}

typedef struct {
    int64_t spec[13];
    Py_ssize_t n;
    int64_t *blocks, *pages;
} Job;

/* ------------------------------------------------------------------------------------------------ a copy queue
 * CopyQueue(): one native thread that never takes the GIL, running copy_kv_blocks jobs in the order they came.
 *   submit(spec, blocks, pages, load=False, unit=1) -> int or None: the job queued (its contents copied), its ticket
 *       (1, 2, ...); blocks and pages are int64 vectors or lists of ints, pages given as page number * unit (a page's
 *       first slot, with unit the page size); None, nothing queued, when an index is out of range or a page is not
 *       a multiple of unit; start=False leaves the thread asleep if it is (waking it costs the caller a futex
 *       call, and on a VM an interrupt to another CPU: tens of microseconds): the job runs once a later job
 *       starts, start() is called, or a wait() needs it;
 *   start(): wake the thread for the jobs submitted without start;
 *   completed() -> int: the tickets done so far (every ticket up to it: one thread, in order);
 *   wait(ticket): until that ticket is done (the GIL released);
 *   close(): the queued jobs finished, the thread joined (also on deallocation).
 * A layer's store can start as soon as the forward has written the layer (vLLM's save_kv_layer) and run beside the
 * next layers' forward, off the engine's thread. The caller keeps the buffers the specs name alive until their
 * tickets are done. */
typedef struct QJob {
    Job job;
    int load;
    struct QJob *next;
} QJob;

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    QJob *head, *tail;
    int64_t submitted;
    _Atomic int64_t completed;
    int stop, started, joined;
} CopyQueue;

static void *copy_queue_run(void *arg) {
    CopyQueue *q = arg;
    pthread_mutex_lock(&q->mu);
    for (;;) {
        while (!q->head && !q->stop)
            pthread_cond_wait(&q->work, &q->mu);
        QJob *j = q->head;
        if (!j)
            break;  /* stopping, and nothing left */
        pthread_mutex_unlock(&q->mu);
        kv_copy(j->job.spec, j->job.blocks, j->job.pages, j->job.n, j->load);
        pthread_mutex_lock(&q->mu);
        q->head = j->next;
        if (!q->head)
            q->tail = NULL;
        atomic_fetch_add(&q->completed, 1);
        pthread_cond_broadcast(&q->done);
        PyMem_RawFree(j);
    }
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

static void copy_queue_stop(CopyQueue *q) {
    if (q->started && !q->joined) {
        pthread_mutex_lock(&q->mu);
        q->stop = 1;
        pthread_cond_signal(&q->work);
        pthread_mutex_unlock(&q->mu);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(q->thread, NULL);
        Py_END_ALLOW_THREADS
        q->joined = 1;
    }
}

static PyObject *copy_queue_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (!_PyArg_NoKeywords("CopyQueue", kw) || !PyArg_ParseTuple(args, ":CopyQueue"))
        return NULL;
    CopyQueue *q = (CopyQueue *)type->tp_alloc(type, 0);
    if (q == NULL)
        return NULL;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->work, NULL);
    pthread_cond_init(&q->done, NULL);
    atomic_init(&q->completed, 0);
    int err = pthread_create(&q->thread, NULL, copy_queue_run, q);
    if (err) {
        Py_DECREF(q);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    q->started = 1;
    return (PyObject *)q;
}

static void copy_queue_dealloc(CopyQueue *q) {
    copy_queue_stop(q);
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->work);
    pthread_cond_destroy(&q->done);
    Py_TYPE(q)->tp_free((PyObject *)q);
}

/* A list of ints or an int64 vector, as n int64s at out (PyMem_RawMalloc'd by the caller: room for n); -1 raised. */
static int int64_items(PyObject *o, int64_t **out, Py_ssize_t *n, const char *what) {
    if (PyList_Check(o)) {
        *n = PyList_GET_SIZE(o);
        *out = PyMem_RawMalloc((size_t)(*n ? *n : 1) * sizeof(int64_t));
        if (*out == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < *n; i++) {
            long long x = PyLong_AsLongLong(PyList_GET_ITEM(o, i));
            if (x == -1 && PyErr_Occurred()) {
                PyMem_RawFree(*out);
                *out = NULL;
                return -1;
            }
            (*out)[i] = x;
        }
        return 0;
    }
    Py_buffer b;
    if (int64_vector(o, &b, what) < 0)
        return -1;
    *n = b.shape[0];
    *out = PyMem_RawMalloc((size_t)(*n ? *n : 1) * sizeof(int64_t));
    if (*out == NULL) {
        PyBuffer_Release(&b);
        PyErr_NoMemory();
        return -1;
    }  /* (NULL on every failure: the caller frees what it got) */
    memcpy(*out, b.buf, (size_t)*n * sizeof(int64_t));
    PyBuffer_Release(&b);
    return 0;
}

static PyObject *copy_queue_submit(CopyQueue *q, PyObject *args, PyObject *kw) {
    static char *names[] = {"spec", "blocks", "pages", "load", "unit", "start", NULL};
    PyObject *spec_o, *blocks_o, *pages_o;
    int load = 0, start = 1;
    long long unit = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|pLp:submit", names, &spec_o, &blocks_o, &pages_o, &load, &unit,
                                     &start))
        return NULL;
    if (q->joined)
        return PyErr_Format(PyExc_ValueError, "CopyQueue.submit: the queue is closed");
    if (unit < 1)
        return PyErr_Format(PyExc_ValueError, "CopyQueue.submit: unit must be positive");
    Py_buffer spec;
    if (int64_vector(spec_o, &spec, "spec") < 0)
        return NULL;
    int64_t *blocks = NULL, *pages = NULL;
    Py_ssize_t n = 0, n_pages = 0;
    QJob *j = NULL;
    int ok = -1;
    if (int64_items(blocks_o, &blocks, &n, "blocks") < 0)
        goto out;
    if (int64_items(pages_o, &pages, &n_pages, "pages") < 0)
        goto out;
    ok = 1;
    if (unit > 1)  /* first slots of whole pages: page numbers (anything else is not a page here) */
        for (Py_ssize_t i = 0; i < n_pages; i++) {
            if (pages[i] % unit) {
                ok = 0;
                break;
            }
            pages[i] /= unit;
        }
    if (ok > 0)
        ok = kv_check(spec.buf, spec.shape[0], blocks, pages, n, n_pages);
    if (ok > 0) {  /* one allocation: the job, then its blocks and pages */
        j = PyMem_RawMalloc(sizeof(QJob) + 2 * (size_t)(n ? n : 1) * sizeof(int64_t));
        if (j == NULL) {
            PyErr_NoMemory();
            ok = -1;
        } else {
            j->job.blocks = (int64_t *)(j + 1);
            j->job.pages = j->job.blocks + n;
            j->job.n = n;
            j->load = load;
            j->next = NULL;
            memcpy(j->job.spec, spec.buf, sizeof(j->job.spec));
            memcpy(j->job.blocks, blocks, (size_t)n * sizeof(int64_t));
            memcpy(j->job.pages, pages, (size_t)n * sizeof(int64_t));
        }
    }
out:
    PyBuffer_Release(&spec);
    PyMem_RawFree(blocks);
    PyMem_RawFree(pages);
    if (ok < 0)
        return NULL;
    if (ok == 0)
        Py_RETURN_NONE;
    pthread_mutex_lock(&q->mu);
    if (q->tail)
        q->tail->next = j;
    else
        q->head = j;
    q->tail = j;
    int64_t ticket = ++q->submitted;
    if (start)
        pthread_cond_signal(&q->work);
    pthread_mutex_unlock(&q->mu);
    return PyLong_FromLongLong(ticket);
}

static PyObject *copy_queue_completed(CopyQueue *q, PyObject *unused) {
    return PyLong_FromLongLong(atomic_load(&q->completed));
}

static PyObject *copy_queue_wait(CopyQueue *q, PyObject *arg) {
    long long ticket = PyLong_AsLongLong(arg);
    if (ticket == -1 && PyErr_Occurred())
        return NULL;
    if (ticket > q->submitted)
        return PyErr_Format(PyExc_ValueError, "CopyQueue.wait: ticket %lld was never handed out", ticket);
    if (atomic_load(&q->completed) >= ticket)
        Py_RETURN_NONE;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&q->mu);
    pthread_cond_signal(&q->work);  /* (jobs submitted without start) */
    while (atomic_load(&q->completed) < ticket)
        pthread_cond_wait(&q->done, &q->mu);
    pthread_mutex_unlock(&q->mu);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *copy_queue_start(CopyQueue *q, PyObject *unused) {
    pthread_mutex_lock(&q->mu);
    pthread_cond_signal(&q->work);
    pthread_mutex_unlock(&q->mu);
    Py_RETURN_NONE;
}

static PyObject *copy_queue_close(CopyQueue *q, PyObject *unused) {
    copy_queue_stop(q);
    Py_RETURN_NONE;
}

static PyMethodDef copy_queue_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))copy_queue_submit, METH_VARARGS | METH_KEYWORDS,
     "submit(spec, blocks, pages, load=False, unit=1, start=True) -> ticket or None (an index out of range or a "
     "page not a multiple of unit: nothing queued)."},
    {"start", (PyCFunction)copy_queue_start, METH_NOARGS, "Start the jobs submitted without start."},
    {"completed", (PyCFunction)copy_queue_completed, METH_NOARGS, "The tickets done so far."},
    {"wait", (PyCFunction)copy_queue_wait, METH_O, "wait(ticket): until it is done (the GIL released)."},
    {"close", (PyCFunction)copy_queue_close, METH_NOARGS, "Finish the queued jobs and join the thread."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CopyQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "radixd.client._pagecopy.CopyQueue",
    .tp_basicsize = sizeof(CopyQueue),
    .tp_dealloc = (destructor)copy_queue_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A native thread running copy_kv_blocks jobs in order (see the C file).",
    .tp_methods = copy_queue_methods,
    .tp_new = copy_queue_new,
};

static PyMethodDef methods[] = {
    {"copy_pages", (PyCFunction)(void (*)(void))copy_pages, METH_VARARGS | METH_KEYWORDS,
     "copy_pages(plan, src, dst, page, nogil=False, strided=False, threads=1) -> bool: every buffer pair's page rows "
     "at src's "
     "pages into "
     "dst's (False, nothing copied, unless both are whole pages in order within every buffer)."},
    {"copy_kv_blocks", (PyCFunction)(void (*)(void))copy_kv_blocks, METH_VARARGS | METH_KEYWORDS,
     "copy_kv_blocks(spec, blocks, pages, load) -> bool: one layer's vLLM CPU blocks <-> radixd pages (False, "
     "nothing copied, when an index is out of range)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pagecopy",
                                    "Whole-page KV copies in one call (see the C file's header).", -1, methods};

PyMODINIT_FUNC PyInit__pagecopy(void) {
    if (PyType_Ready(&CopyQueueType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&CopyQueueType);
    if (PyModule_AddObject(m, "CopyQueue", (PyObject *)&CopyQueueType) < 0) {
        Py_DECREF(&CopyQueueType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
