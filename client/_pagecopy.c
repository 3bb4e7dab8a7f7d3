/* Whole-page KV copies between an engine's CPU pool and radixd's mapped pool, in one call (optional: the engine
 * integrations fall back to numpy without it).
 *
 * An engine's scheduler thread runs each copy cache-cold: checking that the slots are whole pages in order and
 * copying them took some twenty numpy calls, whose dispatch cost more than the bytes. Here the check and every
 * buffer's page rows are one call.
 *
 * copy_pages(plan, src, dst, page, nogil=False) -> bool
 *   plan: int64 buffer of (src_addr, src_pages, dst_addr, dst_pages, row_bytes) per buffer pair: a page row p
 *         of a buffer is row_bytes bytes at addr + p * row_bytes (the caller keeps the buffers alive);
 *   src, dst: int64 slot vectors of the same length, whole pages in order (page p's slots p*page ... p*page +
 *         page - 1, the pages in any order);
 *   returns False, having copied nothing, unless both are whole pages within every buffer; with nogil, the
 *   bytes are copied with the GIL released (a background thread's copy).
 *
 * copy_kv_blocks(spec, blocks, pages, load, nogil=False) -> bool
 *   one layer's pages between a vLLM CPU block cache whose blocks are strided views of K and V (vLLM 0.32.0's
 *   vec kernels, as integrations/vllm/layout.py probed them) and radixd's K and V buffers [slots, heads, dim];
 *   spec: int64 buffer (kv_addr, num_blocks, k_addr, v_addr, radixd_pages, block_size, heads, head_dim,
 *         elem_size, heads_out, k_cols, v_cols): a block is [heads][2][block_size * head_dim] (heads_out) or
 *         [2][heads][...], each kind's chunk row-major [token][dim] or column-major [dim][token] (k_cols, v_cols);
 *   blocks, pages: int64 vectors of the same length, vLLM block i <-> radixd page i; load: radixd -> vLLM;
 *   returns False, having copied nothing, when an index is out of range; nogil as for copy_pages. */
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

static PyObject *copy_pages(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"plan", "src", "dst", "page", "nogil", NULL};
    PyObject *plan_o, *src_o, *dst_o;
    Py_ssize_t page;
    int nogil = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOn|p:copy_pages", names, &plan_o, &src_o, &dst_o, &page, &nogil))
        return NULL;
    if (page < 1)
        return PyErr_Format(PyExc_ValueError, "copy_pages: page must be >= 1, got %zd", page);
    Py_buffer v[3];
    if (int64_vectors((PyObject *const[]){plan_o, src_o, dst_o}, (const char *const[]){"plan", "src", "dst"}, v) < 0)
        return NULL;
    Py_buffer *plan = &v[0], *src = &v[1], *dst = &v[2];
    PyObject *result = NULL;
    int64_t *at = NULL;
    const int64_t *p = plan->buf;
    Py_ssize_t pairs = plan->shape[0] / 5, n = src->shape[0], pages = n / page;
    if (plan->shape[0] % 5) {
        PyErr_SetString(PyExc_ValueError, "copy_pages: plan holds 5 int64s per buffer pair");
        goto done;
    }
    if (dst->shape[0] != n || n % page || pairs == 0) {
        result = Py_False;
        goto done;
    }
    int64_t src_limit = INT64_MAX, dst_limit = INT64_MAX;
    for (Py_ssize_t k = 0; k < pairs; k++) {
        const int64_t *e = p + 5 * k;
        if (e[0] == 0 || e[2] == 0 || e[1] < 0 || e[3] < 0 || e[4] <= 0) {
            PyErr_SetString(PyExc_ValueError, "copy_pages: a plan entry has a null address or a bad size");
            goto done;
        }
        src_limit = e[1] < src_limit ? e[1] : src_limit;
        dst_limit = e[3] < dst_limit ? e[3] : dst_limit;
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
    for (Py_ssize_t k = 0; k < pairs; k++) {
        const int64_t *e = p + 5 * k;
        const char *s = (const char *)(uintptr_t)e[0];
        char *d = (char *)(uintptr_t)e[2];
        size_t row = (size_t)e[4];
        for (Py_ssize_t i = 0; i < pages; i++)
            memcpy(d + (size_t)to[i] * row, s + (size_t)at[i] * row, row);
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
                T *run = r + (t * h + head) * d;                                                                     \
                if (load)                                                                                            \
                    memcpy(c + t * d, run, (size_t)d * sizeof(T));                                                   \
                else                                                                                                 \
                    memcpy(run, c + t * d, (size_t)d * sizeof(T));                                                   \
            }                                                                                                        \
        } else if (load) {                                                                                           \
            for (int64_t j = 0; j < d; j++)                                                                          \
                for (int64_t t = 0; t < b; t++)                                                                      \
                    c[j * b + t] = r[(t * h + head) * d + j];                                                        \
        } else {                                                                                                     \
            for (int64_t j = 0; j < d; j++)                                                                          \
                for (int64_t t = 0; t < b; t++)                                                                      \
                    r[(t * h + head) * d + j] = c[j * b + t];                                                        \
        }                                                                                                            \
    } while (0)

/* A copy_kv_blocks spec and its index vectors checked: 1 fine, 0 an index out of range, -1 a bad spec (raised). */
static int kv_check(const int64_t *sp, Py_ssize_t spec_len, const int64_t *bi, const int64_t *pi, Py_ssize_t n,
                    Py_ssize_t n_pages) {
    if (spec_len != 12) {
        PyErr_SetString(PyExc_ValueError, "copy_kv_blocks: spec holds 12 int64s");
        return -1;
    }
    int64_t b = sp[5], h = sp[6], d = sp[7], es = sp[8];
    if (!sp[0] || !sp[2] || !sp[3] || b <= 0 || h <= 0 || d <= 0 || (es != 1 && es != 2 && es != 4 && es != 8)) {
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
    int64_t b = sp[5], h = sp[6], d = sp[7], es = sp[8];
    int heads_out = sp[9] != 0, k_cols = sp[10] != 0, v_cols = sp[11] != 0;
    size_t chunk_bytes = (size_t)(b * d * es), block_bytes = 2 * (size_t)h * chunk_bytes;
    size_t page_bytes = (size_t)(b * h * d * es);
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
    static char *names[] = {"spec", "blocks", "pages", "load", "nogil", NULL};
    PyObject *spec_o, *blocks_o, *pages_o;
    int load, nogil = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOp|p:copy_kv_blocks", names, &spec_o, &blocks_o, &pages_o, &load,
                                     &nogil))
        return NULL;
    Py_buffer v[3];
    if (int64_vectors((PyObject *const[]){spec_o, blocks_o, pages_o}, (const char *const[]){"spec", "blocks", "pages"},
                      v) < 0)
        return NULL;
    PyObject *result = NULL;
    const int64_t *sp = v[0].buf, *bi = v[1].buf, *pi = v[2].buf;
    Py_ssize_t n = v[1].shape[0];
    int ok = kv_check(sp, v[0].shape[0], bi, pi, n, v[2].shape[0]);
    if (ok > 0) {
        PyThreadState *released = nogil ? PyEval_SaveThread() : NULL;
        kv_copy(sp, bi, pi, n, load);
        if (released)
            PyEval_RestoreThread(released);
    }
    if (ok >= 0)
        result = ok ? Py_True : Py_False;
    release3(v);
    Py_XINCREF(result);
    return result;
}

/* ------------------------------------------------------------------------------------------------ in background
 * copy_kv_blocks_in_background(jobs, load=False) -> CopyTask or None
 *   jobs: (spec, blocks, pages) per layer, as for copy_kv_blocks; their contents are copied, and every layer's copy
 *   runs on a thread of its own that never takes the GIL, so the engine's thread goes on at once (an asynchronous
 *   store on CPU, as a side stream on GPU); the task's query() says whether it is over and synchronize() waits for
 *   it (a CUDA event's two calls). None, with nothing started, when an index is out of range. The caller keeps the
 *   buffers the specs name alive until the task is over. */
typedef struct {
    int64_t spec[12];
    Py_ssize_t n;
    int64_t *blocks, *pages;
} Job;

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    int started, joined, load;
    int njobs;
    Job *jobs;
    atomic_int done;
} CopyTask;

static void *copy_task_run(void *arg) {
    CopyTask *t = arg;
    for (int j = 0; j < t->njobs; j++)
        kv_copy(t->jobs[j].spec, t->jobs[j].blocks, t->jobs[j].pages, t->jobs[j].n, t->load);
    atomic_store(&t->done, 1);
    return NULL;
}

static void copy_task_join(CopyTask *t) {
    if (t->started && !t->joined) {
        Py_BEGIN_ALLOW_THREADS
        pthread_join(t->thread, NULL);
        Py_END_ALLOW_THREADS
        t->joined = 1;
    }
}

static void copy_task_dealloc(CopyTask *t) {
    copy_task_join(t);
    if (t->jobs) {
        for (int j = 0; j < t->njobs; j++)
            PyMem_RawFree(t->jobs[j].blocks);
        PyMem_RawFree(t->jobs);
    }
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyObject *copy_task_query(CopyTask *t, PyObject *unused) {
    return PyBool_FromLong(atomic_load(&t->done));
}

static PyObject *copy_task_synchronize(CopyTask *t, PyObject *unused) {
    copy_task_join(t);
    Py_RETURN_NONE;
}

static PyMethodDef copy_task_methods[] = {
    {"query", (PyCFunction)copy_task_query, METH_NOARGS, "Whether the copy is over."},
    {"synchronize", (PyCFunction)copy_task_synchronize, METH_NOARGS, "Wait for the copy (the GIL released)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CopyTaskType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "radixd.client._pagecopy.CopyTask",
    .tp_basicsize = sizeof(CopyTask),
    .tp_dealloc = (destructor)copy_task_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A background copy of KV blocks (copy_kv_blocks_in_background).",
    .tp_methods = copy_task_methods,
};

static PyObject *copy_kv_blocks_in_background(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"jobs", "load", NULL};
    PyObject *jobs_o;
    int load = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|p:copy_kv_blocks_in_background", names, &jobs_o, &load))
        return NULL;
    PyObject *seq = PySequence_Fast(jobs_o, "copy_kv_blocks_in_background: jobs must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t njobs = PySequence_Fast_GET_SIZE(seq);
    if (njobs > INT_MAX) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "copy_kv_blocks_in_background: too many jobs");
    }
    CopyTask *t = PyObject_New(CopyTask, &CopyTaskType);
    if (t == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    t->started = t->joined = 0;
    t->load = load;
    t->njobs = 0;
    atomic_init(&t->done, 0);
    t->jobs = PyMem_RawCalloc(njobs ? (size_t)njobs : 1, sizeof(Job));
    if (t->jobs == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t j = 0; j < njobs; j++) {
        PyObject *job = PySequence_Fast_GET_ITEM(seq, j);
        PyObject *spec_o, *blocks_o, *pages_o;
        if (!PyArg_ParseTuple(job, "OOO:copy_kv_blocks_in_background job", &spec_o, &blocks_o, &pages_o))
            goto fail;
        Py_buffer v[3];
        if (int64_vectors((PyObject *const[]){spec_o, blocks_o, pages_o},
                          (const char *const[]){"spec", "blocks", "pages"}, v) < 0)
            goto fail;
        Py_ssize_t n = v[1].shape[0];
        int ok = kv_check(v[0].buf, v[0].shape[0], v[1].buf, v[2].buf, n, v[2].shape[0]);
        Job *J = &t->jobs[t->njobs];
        if (ok > 0) {
            J->blocks = PyMem_RawMalloc(2 * (size_t)(n ? n : 1) * sizeof(int64_t));
            if (J->blocks == NULL) {
                PyErr_NoMemory();
                ok = -1;
            } else {
                t->njobs++;
                J->pages = J->blocks + n;
                J->n = n;
                memcpy(J->spec, v[0].buf, sizeof(J->spec));
                memcpy(J->blocks, v[1].buf, (size_t)n * sizeof(int64_t));
                memcpy(J->pages, v[2].buf, (size_t)n * sizeof(int64_t));
            }
        }
        release3(v);
        if (ok < 0)
            goto fail;
        if (ok == 0) {  /* an index out of range: nothing starts */
            Py_DECREF(seq);
            Py_DECREF(t);
            Py_RETURN_NONE;
        }
    }
    Py_DECREF(seq);
    int err = pthread_create(&t->thread, NULL, copy_task_run, t);
    if (err) {
        Py_DECREF(t);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    t->started = 1;
    return (PyObject *)t;
fail:
    Py_DECREF(seq);
    Py_DECREF(t);
    return NULL;
}

static PyMethodDef methods[] = {
    {"copy_pages", (PyCFunction)(void (*)(void))copy_pages, METH_VARARGS | METH_KEYWORDS,
     "copy_pages(plan, src, dst, page, nogil=False) -> bool: every buffer pair's page rows at src's pages into "
     "dst's (False, nothing copied, unless both are whole pages in order within every buffer)."},
    {"copy_kv_blocks_in_background", (PyCFunction)(void (*)(void))copy_kv_blocks_in_background,
     METH_VARARGS | METH_KEYWORDS,
     "copy_kv_blocks_in_background(jobs, load=False) -> CopyTask or None: the layers' (spec, blocks, pages) copies "
     "on a native thread that never takes the GIL (None, nothing started, when an index is out of range)."},
    {"copy_kv_blocks", (PyCFunction)(void (*)(void))copy_kv_blocks, METH_VARARGS | METH_KEYWORDS,
     "copy_kv_blocks(spec, blocks, pages, load, nogil=False) -> bool: one layer's vLLM CPU blocks <-> radixd pages (False, "
     "nothing copied, when an index is out of range)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pagecopy",
                                    "Whole-page KV copies in one call (see the C file's header).", -1, methods};

PyMODINIT_FUNC PyInit__pagecopy(void) {
    if (PyType_Ready(&CopyTaskType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&CopyTaskType);
    if (PyModule_AddObject(m, "CopyTask", (PyObject *)&CopyTaskType) < 0) {
        Py_DECREF(&CopyTaskType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
