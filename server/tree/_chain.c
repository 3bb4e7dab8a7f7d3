/* The page-hash chain of hashes.py in C: one call hashes every page of a key (the GIL released
 * for a long one).
 *
 * chain(data, page_nbytes, prior) -> bytes: digest_i = SHA-256(digest_{i-1} || page_i), digest_{-1} = prior
 * (None or b"": nothing). Byte-for-byte the pure-Python chain; a known-answer test holds them equal.
 * The low-level SHA256_* calls are OpenSSL's fastest path for many small messages (SHA-NI when the CPU
 * has it); they are deprecated in OpenSSL 3 but exported, and stable.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define OPENSSL_API_COMPAT 10101
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/sha.h>
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

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS, "Digests of every page of data (32 bytes each), continuing from prior."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chain", "Native page-hash chain.", -1, methods};

PyMODINIT_FUNC PyInit__chain(void) { return PyModule_Create(&module); }
