// Package deploy holds the Prometheus and Grafana files for kvflow
// (prometheus/, grafana/) and, in its tests, the check that every metric
// the dashboard and the alert rules query is one a prefill or decode worker
// registers, with the labels and label values the queries match on.
package deploy
