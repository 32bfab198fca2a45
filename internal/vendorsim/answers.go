package vendorsim

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"hash/fnv"
	"io"
	"net/http"
	"strconv"
	"strings"
)

// answerBody is the body Answer builds; its fields marshal in this order.
type answerBody struct {
	ID            string `json:"id"`
	Method        string `json:"method"`
	Path          string `json:"path"`
	RequestSHA256 string `json:"request_sha256"`
	Waybill       string `json:"waybill"`
	Pad           string `json:"pad"`
}

// Answer is the body a Mock with AnswerBytes n sends to an admitted
// request: the JSON object
//
//	{"id":KEY,"method":METHOD,"path":PATH,"request_sha256":HEX,"waybill":WAYBILL,"pad":"xxx..."}
//
// where KEY is the request's Idempotency-Key ("" without one), PATH its
// URL path without the query, HEX the SHA-256 of its body and WAYBILL is
// Waybill(KEY). The pad makes the body exactly n bytes; when n is smaller
// than the body with an empty pad, the body is that, longer than n. The
// same arguments always give the same bytes, so a test can recompute what
// the vendor answered.
func Answer(method, path, key string, body []byte, n int) []byte {
	sum := sha256.Sum256(body)
	a := answerBody{ID: key, Method: method, Path: path, RequestSHA256: hex.EncodeToString(sum[:]), Waybill: Waybill(key)}
	b, _ := json.Marshal(a) // strings only: cannot fail
	if len(b) >= n {
		return b
	}
	a.Pad = strings.Repeat("x", n-len(b)) // "x" marshals as one byte
	b, _ = json.Marshal(a)
	return b
}

// Waybill is the waybill number Answer derives from an Idempotency-Key:
// "WB-" and the first 12 hex digits, upper case, of the key's SHA-256.
func Waybill(key string) string {
	sum := sha256.Sum256([]byte(key))
	return "WB-" + strings.ToUpper(hex.EncodeToString(sum[:6]))
}

// FailsEvery reports whether a Mock with FailEvery every answers 422 to
// requests carrying key: key is not empty and its 64-bit FNV-1a hash
// (hash/fnv's New64a) is a multiple of every. About one key in every
// fails, the same ones in every run. An every below 1 fails none.
func FailsEvery(key string, every int) bool {
	if key == "" || every < 1 {
		return false
	}
	h := fnv.New64a()
	h.Write([]byte(key))
	return h.Sum64()%uint64(every) == 0
}

// fails reports whether the vendor answers 422 to requests carrying key.
func (v *Mock) fails(key string) bool {
	return key != "" && (v.FailKeys[key] || FailsEvery(key, v.FailEvery))
}

// failure is the body of a 422 answer to a request carrying key.
func failure(key string) []byte {
	b, _ := json.Marshal(struct {
		Error string `json:"error"`
		ID    string `json:"id"`
	}{"validation failed", key})
	return b
}

// maxRequestBody bounds the request body read to compute an Answer.
const maxRequestBody = 32 << 20

// writeAnswer writes Answer for r. A body that cannot be read (cut off,
// or above 32 MiB) is answered 400, while the record keeps the status
// decided before the body was read.
func (v *Mock) writeAnswer(w http.ResponseWriter, r *http.Request, status int) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxRequestBody))
	if err != nil {
		writeJSON(w, http.StatusBadRequest, errorBody("vendorsim: reading the request body: "+err.Error()))
		return
	}
	writeJSON(w, status, Answer(r.Method, r.URL.Path, r.Header.Get("Idempotency-Key"), body, v.AnswerBytes))
}

// errorBody is {"error":msg}.
func errorBody(msg string) []byte {
	b, _ := json.Marshal(struct {
		Error string `json:"error"`
	}{msg})
	return b
}

// writeJSON writes a JSON answer.
func writeJSON(w http.ResponseWriter, status int, body []byte) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	w.Write(body)
}
