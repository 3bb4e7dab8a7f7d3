/* KV event batches in C: resolve the tree's lazy page digests and encode the msgpack batch (the GIL released
 * for a large batch).
 *
 * encode_batch(records, ts, page_size, key_itemsize, bigram) -> bytes
 *   records: the tree's raw records (server/tree/events.py), spans and runs as server/tree/hashes.py makes
 *   them. Every unresolved run they reach is hashed (SHA-256 chain, as hashes.chain) and stored back into
 *   its run list, exactly as hashes.resolve would; the result is the msgpack batch [ts, [events], nil],
 *   byte for byte what server/events.py's msgspec encoder writes for RawEvents.materialize() (a test holds
 *   them equal). Coalescing follows R6.4 as tree/events.Coalescer does.
 * Three phases: gather (GIL held, pointers and references only), hash + encode (GIL released when it hashes
 * 64 KiB or more), store the digests back (GIL held). Another thread resolving the same run meanwhile computes the
 * same bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define OPENSSL_API_COMPAT 10101
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/sha.h>
#include <stdint.h>
#include <string.h>

#define DIG 32
#define RELEASE_BYTES (64 * 1024) /* hashing below this keeps the GIL: a hand-over costs more */

/* ------------------------------------------------------------------ growable byte buffer */
typedef struct { unsigned char *p; size_t n, cap; int oom; } Buf;

static void b_need(Buf *b, size_t k) {
    if (b->oom || b->n + k <= b->cap) return;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->n + k) cap *= 2;
    unsigned char *p = realloc(b->p, cap);
    if (!p) { b->oom = 1; return; }
    b->p = p; b->cap = cap;
}
static void b_put(Buf *b, const void *src, size_t k) { b_need(b, k); if (!b->oom) { memcpy(b->p + b->n, src, k); b->n += k; } }
static void b_u8(Buf *b, unsigned v) { unsigned char c = (unsigned char)v; b_put(b, &c, 1); }
static void b_be(Buf *b, uint64_t v, int bytes) {
    unsigned char t[8];
    for (int i = 0; i < bytes; i++) t[i] = (unsigned char)(v >> (8 * (bytes - 1 - i)));
    b_put(b, t, bytes);
}
static void mp_int(Buf *b, int64_t v) {  /* the smallest encoding, as msgspec writes it */
    if (v >= 0) {
        if (v < 128) b_u8(b, (unsigned)v);
        else if (v <= 0xff) { b_u8(b, 0xcc); b_be(b, (uint64_t)v, 1); }
        else if (v <= 0xffff) { b_u8(b, 0xcd); b_be(b, (uint64_t)v, 2); }
        else if (v <= 0xffffffffLL) { b_u8(b, 0xce); b_be(b, (uint64_t)v, 4); }
        else { b_u8(b, 0xcf); b_be(b, (uint64_t)v, 8); }
    } else {
        if (v >= -32) b_u8(b, (unsigned)(0xe0 | (v + 32)));
        else if (v >= -128) { b_u8(b, 0xd0); b_be(b, (uint64_t)v, 1); }
        else if (v >= -32768) { b_u8(b, 0xd1); b_be(b, (uint64_t)v, 2); }
        else if (v >= -2147483648LL) { b_u8(b, 0xd2); b_be(b, (uint64_t)v, 4); }
        else { b_u8(b, 0xd3); b_be(b, (uint64_t)v, 8); }
    }
}
static void mp_str(Buf *b, const char *s, size_t n) {
    if (n < 32) b_u8(b, 0xa0 | (unsigned)n);
    else if (n <= 0xff) { b_u8(b, 0xd9); b_be(b, n, 1); }
    else if (n <= 0xffff) { b_u8(b, 0xda); b_be(b, n, 2); }
    else { b_u8(b, 0xdb); b_be(b, n, 4); }
    b_put(b, s, n);
}
static void mp_cstr(Buf *b, const char *s) { mp_str(b, s, strlen(s)); }
static void mp_array(Buf *b, size_t n) {
    if (n < 16) b_u8(b, 0x90 | (unsigned)n);
    else if (n <= 0xffff) { b_u8(b, 0xdc); b_be(b, n, 2); }
    else { b_u8(b, 0xdd); b_be(b, n, 4); }
}
static void mp_map(Buf *b, size_t n) { b_u8(b, 0x80 | (unsigned)n); }  /* at most 8 entries here */

static int64_t block_hash(const unsigned char *d) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = (v << 8) | d[i];
    return (int64_t)v;
}

/* The published block hash of a digest: namespaced by its namespace's event seed when it has one (hashes.py). */
static int64_t pub_hash(const unsigned char *seed, const unsigned char *d) {
    if (!seed) return block_hash(d);
    unsigned char out[DIG];
    SHA256_CTX s;  /* (the low-level context: OpenSSL 3's one-shot SHA256() fetches an EVP method per call) */
    SHA256_Init(&s);
    SHA256_Update(&s, seed, DIG);
    SHA256_Update(&s, d, 8);
    SHA256_Final(out, &s);
    return block_hash(out);
}

/* ------------------------------------------------------------------ hashing jobs */
typedef struct {
    PyObject *run;        /* borrowed from the records (kept alive by them) */
    PyObject *key;        /* new reference: the run's key bytes */
    Py_ssize_t step;      /* page bytes as hashed */
    int bigram;
    int prior_kind;       /* 0 none, 1 seed bytes, 2 another job's page, 3 a resolved digest */
    unsigned char seed[DIG];
    Py_ssize_t prior_job, prior_page;
    unsigned char *out;   /* pages * 32 */
    Py_ssize_t pages;
} Job;

typedef struct {
    Job *jobs; Py_ssize_t n, cap;
    PyObject **refs; Py_ssize_t nrefs, caprefs;  /* resolved values we read from: kept alive */
    PyObject *index;                              /* dict: id(run) -> job index */
} Ctx;

static int keep(Ctx *c, PyObject *o) {
    if (c->nrefs == c->caprefs) {
        Py_ssize_t cap = c->caprefs ? c->caprefs * 2 : 64;
        PyObject **r = PyMem_Realloc(c->refs, cap * sizeof(PyObject *));
        if (!r) { PyErr_NoMemory(); return -1; }
        c->refs = r; c->caprefs = cap;
    }
    Py_INCREF(o);
    c->refs[c->nrefs++] = o;
    return 0;
}

/* Where a run's digests will be: *res set to a resolved bytes' data, or *job to a job index. */
static int ensure(Ctx *c, PyObject *run, const unsigned char **res, Py_ssize_t *job, int depth) {
    *res = NULL; *job = -1;
    if (!PyList_Check(run) || PyList_GET_SIZE(run) != 4) { PyErr_SetString(PyExc_TypeError, "bad digest run"); return -1; }
    if (depth > 100000) { PyErr_SetString(PyExc_RecursionError, "digest runs chain too deep"); return -1; }
    PyObject *value = PyList_GET_ITEM(run, 0);
    if (value != Py_None) {
        if (!PyBytes_Check(value)) { PyErr_SetString(PyExc_TypeError, "bad digest value"); return -1; }
        if (keep(c, value) < 0) return -1;
        *res = (const unsigned char *)PyBytes_AS_STRING(value);
        return 0;
    }
    PyObject *id = PyLong_FromVoidPtr(run);
    if (!id) return -1;
    PyObject *got = PyDict_GetItemWithError(c->index, id);
    if (got) { Py_DECREF(id); *job = PyLong_AsSsize_t(got); return 0; }
    if (PyErr_Occurred()) { Py_DECREF(id); return -1; }
    PyObject *key = PyList_GET_ITEM(run, 1), *prior = PyList_GET_ITEM(run, 2), *fmt = PyList_GET_ITEM(run, 3);
    if (!PyBytes_Check(key) || !PyTuple_Check(fmt) || PyTuple_GET_SIZE(fmt) < 2 || PyTuple_GET_SIZE(fmt) > 3) {
        Py_DECREF(id); PyErr_SetString(PyExc_TypeError, "bad unresolved digest run"); return -1;
    }
    Job j;
    memset(&j, 0, sizeof j);
    j.run = run;
    j.step = PyLong_AsSsize_t(PyTuple_GET_ITEM(fmt, 0));
    j.bigram = PyObject_IsTrue(PyTuple_GET_ITEM(fmt, 1));
    if (j.step <= 0 || PyBytes_GET_SIZE(key) % j.step) {
        Py_DECREF(id); PyErr_SetString(PyExc_ValueError, "digest run key is not whole pages"); return -1;
    }
    j.pages = PyBytes_GET_SIZE(key) / j.step;
    if (prior == Py_None) j.prior_kind = 0;
    else if (PyBytes_Check(prior) && PyBytes_GET_SIZE(prior) == DIG) { j.prior_kind = 1; memcpy(j.seed, PyBytes_AS_STRING(prior), DIG); }
    else if (PyBytes_Check(prior) && PyBytes_GET_SIZE(prior) == 0) j.prior_kind = 0;
    else if (PyTuple_Check(prior) && PyTuple_GET_SIZE(prior) == 2) {
        const unsigned char *pr; Py_ssize_t pj;
        if (ensure(c, PyTuple_GET_ITEM(prior, 0), &pr, &pj, depth + 1) < 0) { Py_DECREF(id); return -1; }
        j.prior_page = PyLong_AsSsize_t(PyTuple_GET_ITEM(prior, 1));
        if (pr) { j.prior_kind = 1; memcpy(j.seed, pr + j.prior_page * DIG, DIG); }
        else { j.prior_kind = 2; j.prior_job = pj; }
    } else { Py_DECREF(id); PyErr_SetString(PyExc_TypeError, "bad digest prior"); return -1; }
    if (c->n == c->cap) {
        Py_ssize_t cap = c->cap ? c->cap * 2 : 64;
        Job *p = PyMem_Realloc(c->jobs, cap * sizeof(Job));
        if (!p) { Py_DECREF(id); PyErr_NoMemory(); return -1; }
        c->jobs = p; c->cap = cap;
    }
    j.out = PyMem_RawMalloc(j.pages ? j.pages * DIG : 1);
    if (!j.out) { Py_DECREF(id); PyErr_NoMemory(); return -1; }
    Py_INCREF(key);
    j.key = key;
    c->jobs[c->n] = j;
    PyObject *ix = PyLong_FromSsize_t(c->n);
    int rc = ix ? PyDict_SetItem(c->index, id, ix) : -1;
    Py_XDECREF(ix);
    Py_DECREF(id);
    if (rc < 0) return -1;
    *job = c->n++;
    return 0;
}

static void run_job(Ctx *c, Job *j) {
    const unsigned char *src = (const unsigned char *)PyBytes_AS_STRING(j->key);
    const unsigned char *prev = NULL;
    if (j->prior_kind == 1) prev = j->seed;
    else if (j->prior_kind == 2) prev = c->jobs[j->prior_job].out + j->prior_page * DIG;
    unsigned char tmp[4096];
    SHA256_CTX s;
    for (Py_ssize_t i = 0; i < j->pages; i++) {
        const unsigned char *page = src + i * j->step;
        SHA256_Init(&s);
        if (prev) SHA256_Update(&s, prev, DIG);
        if (j->bigram) {  /* int64 (first << 32 | second) -> u32 LE first, u32 LE second */
            Py_ssize_t done = 0;
            while (done < j->step) {
                Py_ssize_t k = j->step - done < (Py_ssize_t)sizeof tmp ? j->step - done : (Py_ssize_t)sizeof tmp;
                for (Py_ssize_t q = 0; q < k; q += 8) {
                    uint64_t v; memcpy(&v, page + done + q, 8);
                    uint32_t hi = (uint32_t)(v >> 32), lo = (uint32_t)v;
                    memcpy(tmp + q, &hi, 4); memcpy(tmp + q + 4, &lo, 4);
                }
                SHA256_Update(&s, tmp, (size_t)k);
                done += k;
            }
        } else {
            SHA256_Update(&s, page, (size_t)j->step);
        }
        SHA256_Final(j->out + i * DIG, &s);
        prev = j->out + i * DIG;
    }
}

/* ------------------------------------------------------------------ events */
typedef struct { const unsigned char *p; Py_ssize_t n; const unsigned char *seed; } Seg;
/* digests: n pages (seed: their namespace's event seed, NULL for none); tokens: n tokens */
typedef struct {
    int kind;                        /* 0 stored, 1 removed, 2 cleared */
    Seg *d; Py_ssize_t nd, capd;     /* digest segments (resolved pointers, filled in phase 2) */
    Py_ssize_t *dsrc;                /* per digest segment: -1 resolved (p set) or the job index */
    Py_ssize_t *dlo;
    Seg *t; Py_ssize_t nt, capt;     /* token segments (key bytes) */
    int has_parent; Py_ssize_t psrc, plo; const unsigned char *pres; int64_t parent;
    const char *medium; Py_ssize_t mlen;
    const char *salt; Py_ssize_t slen;  /* salt NULL: none */
    const char *lora; Py_ssize_t llen;  /* lora NULL: the base model */
} Ev;

/* Raw allocators throughout: segments are appended while the GIL is released too. -1: out of memory. */
static int ev_seg(Ev *e, const unsigned char *res, Py_ssize_t job, Py_ssize_t lo, Py_ssize_t hi,
                  const unsigned char *seed) {
    if (e->nd == e->capd) {
        Py_ssize_t cap = e->capd ? e->capd * 2 : 4;
        Seg *d = PyMem_RawRealloc(e->d, cap * sizeof(Seg));
        if (d) e->d = d;
        Py_ssize_t *s = d ? PyMem_RawRealloc(e->dsrc, cap * sizeof(Py_ssize_t)) : NULL;
        if (s) e->dsrc = s;
        Py_ssize_t *l = s ? PyMem_RawRealloc(e->dlo, cap * sizeof(Py_ssize_t)) : NULL;
        if (!l) return -1;
        e->dlo = l; e->capd = cap;
    }
    e->d[e->nd].p = res ? res + lo * DIG : NULL;
    e->d[e->nd].n = hi - lo;
    e->d[e->nd].seed = seed;
    e->dsrc[e->nd] = res ? -1 : job;
    e->dlo[e->nd] = lo;
    e->nd++;
    return 0;
}

static void ev_free(Ev *e) { PyMem_RawFree(e->d); PyMem_RawFree(e->dsrc); PyMem_RawFree(e->dlo); PyMem_RawFree(e->t); }

static int span_of(Ctx *c, PyObject *span, const unsigned char **res, Py_ssize_t *job, Py_ssize_t *lo, Py_ssize_t *hi,
                   const unsigned char **seed) {
    if (!PyTuple_Check(span) || PyTuple_GET_SIZE(span) != 3) { PyErr_SetString(PyExc_TypeError, "bad span"); return -1; }
    *lo = PyLong_AsSsize_t(PyTuple_GET_ITEM(span, 1));
    *hi = PyLong_AsSsize_t(PyTuple_GET_ITEM(span, 2));
    if (PyErr_Occurred()) return -1;
    PyObject *run = PyTuple_GET_ITEM(span, 0);
    if (ensure(c, run, res, job, 0) < 0) return -1;
    *seed = NULL;  /* the run's fmt (page bytes, bigram[, event seed]) names its namespace's seed */
    PyObject *fmt = PyList_GET_ITEM(run, 3);
    if (PyTuple_Check(fmt) && PyTuple_GET_SIZE(fmt) == 3) {
        PyObject *sd = PyTuple_GET_ITEM(fmt, 2);
        if (sd != Py_None) {
            if (!PyBytes_Check(sd) || PyBytes_GET_SIZE(sd) != DIG) { PyErr_SetString(PyExc_TypeError, "bad event seed"); return -1; }
            *seed = (const unsigned char *)PyBytes_AS_STRING(sd);  /* alive: the records hold the run */
        }
    }
    return 0;
}

static const unsigned char *digest_at(Ctx *c, Py_ssize_t src, const unsigned char *res, Py_ssize_t page) {
    return src < 0 ? res + page * DIG : c->jobs[src].out + page * DIG;
}

static void encode_events(Ctx *c, Ev *evs, Py_ssize_t n, double ts, Py_ssize_t page_size, int key_isz, int bigram, Buf *b) {
    /* digests are computed now: fill segment pointers and parent hashes, then coalesce in place */
    for (Py_ssize_t i = 0; i < n; i++) {
        Ev *e = &evs[i];
        for (Py_ssize_t k = 0; k < e->nd; k++)
            if (e->dsrc[k] >= 0) e->d[k].p = c->jobs[e->dsrc[k]].out + e->dlo[k] * DIG;
        if (e->kind == 0 && e->has_parent)
            e->parent = pub_hash(e->d[0].seed, digest_at(c, e->psrc, e->pres, e->plo));  /* one namespace */
    }
    Py_ssize_t out = 0;  /* evs[0..out) are the coalesced events */
    for (Py_ssize_t i = 0; i < n; i++) {
        Ev *e = &evs[i];
        Ev *tail = out ? &evs[out - 1] : NULL;
        if (tail && e->kind == 0 && tail->kind == 0 && tail->nd && e->has_parent &&
                tail->mlen == e->mlen && !memcmp(tail->medium, e->medium, e->mlen) &&
                (tail->salt == NULL) == (e->salt == NULL) &&
                (e->salt == NULL || (tail->slen == e->slen && !memcmp(tail->salt, e->salt, e->slen))) &&
                (tail->lora == NULL) == (e->lora == NULL) &&
                (e->lora == NULL || (tail->llen == e->llen && !memcmp(tail->lora, e->lora, e->llen)))) {
            Seg last = tail->d[tail->nd - 1];
            if (last.n > 0 && pub_hash(last.seed, last.p + (last.n - 1) * DIG) == e->parent) {
                e->kind = -1;  /* merged into the tail below */
            }
        } else if (tail && e->kind == 1 && tail->kind == 1 && tail->mlen == e->mlen &&
                   !memcmp(tail->medium, e->medium, e->mlen)) {
            e->kind = -2;
        }
        if (e->kind < 0) {  /* append segments to the tail */
            int stored = e->kind == -1;
            for (Py_ssize_t k = 0; k < e->nd; k++) {
                Seg s = e->d[k];
                if (ev_seg(tail, s.p, -1, 0, s.n, s.seed) < 0) { b->oom = 1; return; }
            }
            if (stored) {
                for (Py_ssize_t k = 0; k < e->nt; k++) {
                    if (tail->nt == tail->capt) {
                        Py_ssize_t cap = tail->capt ? tail->capt * 2 : 4;
                        Seg *t = PyMem_RawRealloc(tail->t, cap * sizeof(Seg));
                        if (!t) { b->oom = 1; return; }
                        tail->t = t; tail->capt = cap;
                    }
                    tail->t[tail->nt++] = e->t[k];
                }
            }
            continue;
        }
        if (out != i) { Ev tmp = evs[out]; evs[out] = *e; *e = tmp; }
        out++;
    }
    mp_array(b, 3);
    b_u8(b, 0xcb);
    uint64_t bits; memcpy(&bits, &ts, 8);
    b_be(b, bits, 8);
    mp_array(b, (size_t)out);
    for (Py_ssize_t i = 0; i < out; i++) {
        Ev *e = &evs[i];
        if (e->kind == 2) { mp_map(b, 1); mp_cstr(b, "type"); mp_cstr(b, "AllBlocksCleared"); continue; }
        Py_ssize_t pages = 0;
        for (Py_ssize_t k = 0; k < e->nd; k++) pages += e->d[k].n;
        if (e->kind == 1) {
            mp_map(b, 3); mp_cstr(b, "type"); mp_cstr(b, "BlockRemoved");
        } else {
            mp_map(b, e->salt ? 9 : 8); mp_cstr(b, "type"); mp_cstr(b, "BlockStored");
        }
        mp_cstr(b, "block_hashes");
        mp_array(b, (size_t)pages);
        for (Py_ssize_t k = 0; k < e->nd; k++)
            for (Py_ssize_t q = 0; q < e->d[k].n; q++) mp_int(b, pub_hash(e->d[k].seed, e->d[k].p + q * DIG));
        if (e->kind == 0) {
            mp_cstr(b, "parent_block_hash");
            if (e->has_parent) mp_int(b, e->parent); else b_u8(b, 0xc0);
            mp_cstr(b, "token_ids");
            Py_ssize_t toks = 0;
            for (Py_ssize_t k = 0; k < e->nt; k++) toks += e->t[k].n;
            mp_array(b, (size_t)toks);
            for (Py_ssize_t k = 0; k < e->nt; k++) {
                const unsigned char *p = e->t[k].p;
                for (Py_ssize_t q = 0; q < e->t[k].n; q++) {
                    if (key_isz == 8) {
                        int64_t v; memcpy(&v, p + q * 8, 8);
                        if (bigram) {  /* a pair, as SGLang publishes bigram atoms: [first, second] */
                            mp_array(b, 2);
                            mp_int(b, v >> 32);
                            mp_int(b, (int32_t)(uint32_t)v);
                        } else {
                            mp_int(b, v);
                        }
                    } else {
                        int32_t v; memcpy(&v, p + q * 4, 4);
                        mp_int(b, v);
                    }
                }
            }
            mp_cstr(b, "block_size"); mp_int(b, page_size);
            mp_cstr(b, "lora_id"); b_u8(b, 0xc0);
        }
        mp_cstr(b, "medium"); mp_str(b, e->medium, (size_t)e->mlen);
        if (e->kind == 0) {  /* always written: vLLM 0.32's decoder has no default for it */
            mp_cstr(b, "lora_name");
            if (e->lora) mp_str(b, e->lora, (size_t)e->llen); else b_u8(b, 0xc0);
        }
        if (e->kind == 0 && e->salt) { mp_cstr(b, "cache_salt"); mp_str(b, e->salt, (size_t)e->slen); }
    }
    b_u8(b, 0xc0);  /* data_parallel_rank: none */
}

static PyObject *encode_batch(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *records;
    double ts;
    Py_ssize_t page_size;
    int key_isz, bigram;
    if (!PyArg_ParseTuple(args, "O!dnip", &PyList_Type, &records, &ts, &page_size, &key_isz, &bigram)) return NULL;
    if (key_isz != 4 && key_isz != 8) { PyErr_SetString(PyExc_ValueError, "key item size must be 4 or 8"); return NULL; }
    Ctx c;
    memset(&c, 0, sizeof c);
    c.index = PyDict_New();
    if (!c.index) return NULL;
    Py_INCREF(records);
    Py_ssize_t n = PyList_GET_SIZE(records);
    Ev *evs = PyMem_RawCalloc(n ? n : 1, sizeof(Ev));
    PyObject *result = NULL;
    Buf b = {0};
    if (!evs) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {  /* phase 1: gather */
        PyObject *rec = PyList_GET_ITEM(records, i);
        Ev *e = &evs[i];
        if (!PyTuple_Check(rec) || PyTuple_GET_SIZE(rec) < 1) { PyErr_SetString(PyExc_TypeError, "bad event record"); goto done; }
        long kind = PyLong_AsLong(PyTuple_GET_ITEM(rec, 0));
        e->kind = (int)kind;
        const unsigned char *res, *seed; Py_ssize_t job, lo, hi;
        if (kind == 0 && PyTuple_GET_SIZE(rec) == 7) {
            if (span_of(&c, PyTuple_GET_ITEM(rec, 1), &res, &job, &lo, &hi, &seed) < 0) goto done;
            if (ev_seg(e, res, job, lo, hi, seed) < 0) { PyErr_NoMemory(); goto done; }
            PyObject *parent = PyTuple_GET_ITEM(rec, 2);
            if (parent != Py_None) {
                Py_ssize_t plo, phi;
                const unsigned char *pseed;
                if (span_of(&c, parent, &e->pres, &e->psrc, &plo, &phi, &pseed) < 0) goto done;
                e->has_parent = 1;
                e->plo = phi - 1;
                if (e->pres) e->psrc = -1;
            }
            PyObject *key = PyTuple_GET_ITEM(rec, 3);
            if (!PyBytes_Check(key)) { PyErr_SetString(PyExc_TypeError, "bad record key"); goto done; }
            e->t = PyMem_RawMalloc(sizeof(Seg));
            if (!e->t) { PyErr_NoMemory(); goto done; }
            e->t[0].p = (const unsigned char *)PyBytes_AS_STRING(key);
            e->t[0].n = PyBytes_GET_SIZE(key) / key_isz;
            e->nt = e->capt = 1;
            e->medium = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(rec, 4), &e->mlen);
            if (!e->medium) goto done;
            PyObject *salt = PyTuple_GET_ITEM(rec, 5);
            if (salt != Py_None && !(e->salt = PyUnicode_AsUTF8AndSize(salt, &e->slen))) goto done;
            PyObject *lora = PyTuple_GET_ITEM(rec, 6);
            if (lora != Py_None && !(e->lora = PyUnicode_AsUTF8AndSize(lora, &e->llen))) goto done;
        } else if (kind == 1 && PyTuple_GET_SIZE(rec) == 3) {
            PyObject *spans = PyTuple_GET_ITEM(rec, 1);
            if (!PyList_Check(spans)) { PyErr_SetString(PyExc_TypeError, "bad removed spans"); goto done; }
            for (Py_ssize_t k = 0; k < PyList_GET_SIZE(spans); k++)
                if (span_of(&c, PyList_GET_ITEM(spans, k), &res, &job, &lo, &hi, &seed) < 0) goto done;
                else if (ev_seg(e, res, job, lo, hi, seed) < 0) { PyErr_NoMemory(); goto done; }
            e->medium = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(rec, 2), &e->mlen);
            if (!e->medium) goto done;
        } else if (kind == 2) {
        } else {
            PyErr_SetString(PyExc_TypeError, "bad event record");
            goto done;
        }
    }
    Py_ssize_t hashed = 0;  /* phase 2: hash, coalesce, encode */
    for (Py_ssize_t j = 0; j < c.n; j++) hashed += c.jobs[j].pages * c.jobs[j].step;
    PyThreadState *released = hashed >= RELEASE_BYTES ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t j = 0; j < c.n; j++) run_job(&c, &c.jobs[j]);
    encode_events(&c, evs, n, ts, page_size, key_isz, bigram, &b);
    if (released != NULL) PyEval_RestoreThread(released);
    if (b.oom) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t j = 0; j < c.n; j++) {  /* phase 3: store the digests back into their runs */
        Job *jb = &c.jobs[j];
        if (PyList_GET_ITEM(jb->run, 0) != Py_None) continue;  /* another thread got there first */
        PyObject *value = PyBytes_FromStringAndSize((const char *)jb->out, jb->pages * DIG);
        PyObject *prior = jb->prior_kind == 0 ? (Py_INCREF(Py_None), Py_None)
            : PyBytes_FromStringAndSize((const char *)(jb->prior_kind == 1 ? jb->seed
                                        : c.jobs[jb->prior_job].out + jb->prior_page * DIG), DIG);
        if (!value || !prior) { Py_XDECREF(value); Py_XDECREF(prior); goto done; }
        PyList_SetItem(jb->run, 0, value);   /* value first: a reader that finds the key gone finds it */
        PyList_SetItem(jb->run, 2, prior);
        Py_INCREF(Py_None);
        PyList_SetItem(jb->run, 1, Py_None);
    }
    result = PyBytes_FromStringAndSize((const char *)b.p, (Py_ssize_t)b.n);
done:
    if (evs) { for (Py_ssize_t i = 0; i < n; i++) ev_free(&evs[i]); PyMem_RawFree(evs); }
    for (Py_ssize_t j = 0; j < c.n; j++) { Py_DECREF(c.jobs[j].key); PyMem_RawFree(c.jobs[j].out); }
    PyMem_Free(c.jobs);
    for (Py_ssize_t r = 0; r < c.nrefs; r++) Py_DECREF(c.refs[r]);
    PyMem_Free(c.refs);
    Py_DECREF(c.index);
    free(b.p);
    Py_DECREF(records);
    return result;
}

static PyMethodDef methods[] = {
    {"encode_batch", encode_batch, METH_VARARGS,
     "Resolve the records' page digests and encode their msgpack KV event batch (GIL released for a large one)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvevents", "Native KV event batches.", -1, methods};

PyMODINIT_FUNC PyInit__kvevents(void) { return PyModule_Create(&module); }
