/* The page-hash chain of hashes.py in C: one call hashes every page of a key (the GIL released
 * for a long one).
 *
 * chain(data, page_nbytes, prior) -> bytes: digest_i = SHA-256(digest_{i-1} || page_i), digest_{-1} = prior
 * (None or b"": nothing). Byte-for-byte the pure-Python chain; a known-answer test holds them equal.
 * first(tokens, page_size, prior) -> int: the first page's block hash straight from an engine's token ids.
 * The low-level SHA256_* calls are OpenSSL's fastest path for many small messages (SHA-NI when the CPU
 * has it); they are deprecated in OpenSSL 3 but exported, and stable.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define OPENSSL_API_COMPAT 10101
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/sha.h>
#include <stdint.h>
#include <string.h>

#define RELEASE_BYTES (64 * 1024) /* about 50-150 us of hashing: below it the GIL stays held */

static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer data;
    Py_ssize_t step;
    PyObject *prior;
    if (!PyArg_ParseTuple(args, "y*nO", &data, &step, &prior))
        return NULL;
    unsigned char seed[SHA256_DIGEST_LENGTH];
    int seeded = 0;
    if (prior != Py_None) {
        if (!PyBytes_Check(prior) || (PyBytes_GET_SIZE(prior) != 0 && PyBytes_GET_SIZE(prior) != 32)) {
            PyBuffer_Release(&data);
            PyErr_SetString(PyExc_ValueError, "prior must be None, b'' or a 32-byte digest");
            return NULL;
        }
        if (PyBytes_GET_SIZE(prior) == 32) {
            memcpy(seed, PyBytes_AS_STRING(prior), 32);
            seeded = 1;
        }
    }
    if (step <= 0 || data.len % step) {
        PyBuffer_Release(&data);
        PyErr_Format(PyExc_ValueError, "%zd bytes are not whole pages of %zd bytes", data.len, step);
        return NULL;
    }
    Py_ssize_t n = data.len / step;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * SHA256_DIGEST_LENGTH);
    if (out == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    const unsigned char *src = (const unsigned char *)data.buf;
    /* the GIL goes only for a long chain: handing it over costs more than hashing a few pages, and getting it
       back can wait out another thread's switch interval */
    PyThreadState *released = data.len >= RELEASE_BYTES ? PyEval_SaveThread() : NULL;
    const unsigned char *prev = seeded ? seed : NULL;
    SHA256_CTX ctx;
    for (Py_ssize_t i = 0; i < n; i++) {
        SHA256_Init(&ctx);
        if (prev != NULL)
            SHA256_Update(&ctx, prev, SHA256_DIGEST_LENGTH);
        SHA256_Update(&ctx, src + i * step, (size_t)step);
        SHA256_Final(dst + i * SHA256_DIGEST_LENGTH, &ctx);
        prev = dst + i * SHA256_DIGEST_LENGTH;
    }
    if (released != NULL)
        PyEval_RestoreThread(released);
    PyBuffer_Release(&data);
    return out;
}

/* Reads item i of a buffer of integers of `size` bytes (signed when `sign`) as a token id; -1 when it does not
   fit uint32. */
static long long token_at(const char *buf, Py_ssize_t i, int size, int sign) {
    const char *at = buf + i * size;
    long long v;
    switch (size) {
    case 1: v = sign ? (long long)*(const signed char *)at : (long long)*(const unsigned char *)at; break;
    case 2: { short s; unsigned short u; if (sign) { memcpy(&s, at, 2); v = s; } else { memcpy(&u, at, 2); v = u; } break; }
    case 4: { int s; unsigned int u; if (sign) { memcpy(&s, at, 4); v = s; } else { memcpy(&u, at, 4); v = u; } break; }
    default: {
        long long s; unsigned long long u;
        if (sign) { memcpy(&s, at, 8); v = s; }
        else { memcpy(&u, at, 8); v = u > 0xFFFFFFFFull ? -1 : (long long)u; }
    }
    }
    return v < 0 || v > 0xFFFFFFFFll ? -1 : v;
}

/* first(tokens, page_size, prior) -> int: the block hash of the first page of tokens (a list of ints, or a
 * buffer of integers such as array('q')), continuing from prior (None, b"" or a 32-byte digest), in one call:
 * what an engine's scheduler asks of every arriving request, on a thread the forward left cache-cold, where
 * each Python-level call of the packing and hashing costs microseconds. Byte-for-byte hashes.py's chain. */
static PyObject *first(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "first(tokens, page_size, prior)");
        return NULL;
    }
    Py_ssize_t page = PyLong_AsSsize_t(args[1]);
    if (page == -1 && PyErr_Occurred())
        return NULL;
    if (page <= 0 || page > 65536) {
        PyErr_Format(PyExc_ValueError, "page_size %zd out of range", page);
        return NULL;
    }
    PyObject *prior = args[2];
    const unsigned char *seed = NULL;
    if (prior != Py_None) {
        if (!PyBytes_Check(prior) || (PyBytes_GET_SIZE(prior) != 0 && PyBytes_GET_SIZE(prior) != 32)) {
            PyErr_SetString(PyExc_ValueError, "prior must be None, b'' or a 32-byte digest");
            return NULL;
        }
        if (PyBytes_GET_SIZE(prior) == 32)
            seed = (const unsigned char *)PyBytes_AS_STRING(prior);
    }
    unsigned char local[4 * 256];
    unsigned char *data = page <= 256 ? local : PyMem_Malloc((size_t)page * 4);
    if (data == NULL)
        return PyErr_NoMemory();
    int bad = 0;  /* 1: too short, 2: an id not uint32, 3: a Python error set */
    PyObject *tokens = args[0];
    if (PyList_Check(tokens)) {
        if (PyList_GET_SIZE(tokens) < page)
            bad = 1;
        for (Py_ssize_t i = 0; i < page && !bad; i++) {
            PyObject *o = PyNumber_Index(PyList_GET_ITEM(tokens, i));  /* (ints, numpy's integers) */
            if (o == NULL) {
                bad = 3;
                break;
            }
            int over;
            long long v = PyLong_AsLongLongAndOverflow(o, &over);
            Py_DECREF(o);
            if (over || v < 0 || v > 0xFFFFFFFFll) {
                bad = 2;
                break;
            }
            uint32_t u = (uint32_t)v;
            data[4 * i] = u & 0xFF; data[4 * i + 1] = (u >> 8) & 0xFF;
            data[4 * i + 2] = (u >> 16) & 0xFF; data[4 * i + 3] = u >> 24;
        }
    } else {
        Py_buffer view;
        if (PyObject_GetBuffer(tokens, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            bad = 3;
        } else {
            const char *f = view.format ? view.format : "B";
            if (*f == '@' || *f == '=' || *f == '<')
                f++;
            int size = (int)view.itemsize, sign = 0, ok = f[0] != 0 && f[1] == 0;
            switch (ok ? f[0] : 0) {
            case 'b': case 'h': case 'i': case 'l': case 'q': case 'n': sign = 1; break;
            case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N': break;
            default: ok = 0;
            }
            if (!ok || (size != 1 && size != 2 && size != 4 && size != 8)) {
                PyErr_Format(PyExc_TypeError, "token ids must be integers, not a buffer of format '%s'",
                             view.format ? view.format : "B");
                bad = 3;
            } else if (view.len / size < page) {
                bad = 1;
            }
            for (Py_ssize_t i = 0; i < page && !bad; i++) {
                long long v = token_at((const char *)view.buf, i, size, sign);
                if (v < 0) {
                    bad = 2;
                    break;
                }
                uint32_t u = (uint32_t)v;
                data[4 * i] = u & 0xFF; data[4 * i + 1] = (u >> 8) & 0xFF;
                data[4 * i + 2] = (u >> 16) & 0xFF; data[4 * i + 3] = u >> 24;
            }
            PyBuffer_Release(&view);
        }
    }
    PyObject *out = NULL;
    if (bad == 1) {
        PyErr_Format(PyExc_ValueError, "fewer than %zd token ids: no whole page", page);
    } else if (bad == 2) {
        PyErr_SetString(PyExc_OverflowError, "a token id does not fit uint32");
    } else if (!bad) {
        unsigned char digest[SHA256_DIGEST_LENGTH];
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        if (seed != NULL)
            SHA256_Update(&ctx, seed, SHA256_DIGEST_LENGTH);
        SHA256_Update(&ctx, data, (size_t)page * 4);
        SHA256_Final(digest, &ctx);
        unsigned long long h = 0;
        for (int i = 0; i < 8; i++)
            h = (h << 8) | digest[i];
        out = PyLong_FromLongLong((long long)h);
    }
    if (data != local)
        PyMem_Free(data);
    return out;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS, "Digests of every page of data (32 bytes each), continuing from prior."},
    {"first", (PyCFunction)(void (*)(void))first, METH_FASTCALL,
     "The block hash of the first page of tokens (a list or integer buffer), continuing from prior."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chain", "Native page-hash chain.", -1, methods};

PyMODINIT_FUNC PyInit__chain(void) { return PyModule_Create(&module); }
