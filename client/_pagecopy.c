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
    Py_buffer *spec = &v[0], *blk = &v[1], *pg = &v[2];
    PyObject *result = NULL;
    const int64_t *sp = spec->buf, *bi = blk->buf, *pi = pg->buf;
    Py_ssize_t n = blk->shape[0];
    if (spec->shape[0] != 12) {
        PyErr_SetString(PyExc_ValueError, "copy_kv_blocks: spec holds 12 int64s");
        goto done;
    }
    char *kv = (char *)(uintptr_t)sp[0], *kb = (char *)(uintptr_t)sp[2], *vb = (char *)(uintptr_t)sp[3];
    int64_t nblocks = sp[1], npages = sp[4], b = sp[5], h = sp[6], d = sp[7], es = sp[8];
    int heads_out = sp[9] != 0, k_cols = sp[10] != 0, v_cols = sp[11] != 0;
    if (!kv || !kb || !vb || b <= 0 || h <= 0 || d <= 0 || (es != 1 && es != 2 && es != 4 && es != 8)) {
        PyErr_SetString(PyExc_ValueError, "copy_kv_blocks: a null address or a bad geometry in spec");
        goto done;
    }
    if (pg->shape[0] != n) {
        result = Py_False;
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (bi[i] < 0 || bi[i] >= nblocks || pi[i] < 0 || pi[i] >= npages) {
            result = Py_False;
            goto done;
        }
    size_t chunk_bytes = (size_t)(b * d * es), block_bytes = 2 * (size_t)h * chunk_bytes;
    size_t page_bytes = (size_t)(b * h * d * es);
    PyThreadState *released = nogil ? PyEval_SaveThread() : NULL;
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
    if (released)
        PyEval_RestoreThread(released);
    result = Py_True;
done:
    release3(v);
    Py_XINCREF(result);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_pages", (PyCFunction)(void (*)(void))copy_pages, METH_VARARGS | METH_KEYWORDS,
     "copy_pages(plan, src, dst, page, nogil=False) -> bool: every buffer pair's page rows at src's pages into "
     "dst's (False, nothing copied, unless both are whole pages in order within every buffer)."},
    {"copy_kv_blocks", (PyCFunction)(void (*)(void))copy_kv_blocks, METH_VARARGS | METH_KEYWORDS,
     "copy_kv_blocks(spec, blocks, pages, load, nogil=False) -> bool: one layer's vLLM CPU blocks <-> radixd pages (False, "
     "nothing copied, when an index is out of range)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pagecopy",
                                    "Whole-page KV copies in one call (see the C file's header).", -1, methods};

PyMODINIT_FUNC PyInit__pagecopy(void) { return PyModule_Create(&module); }
