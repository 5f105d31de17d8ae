# One place to look: each target runs the command that the README and .ci/run
# use. `make` alone lists them.

GOLANGCI_LINT_VERSION := v2.15.0
GOBIN = $(shell go env GOPATH)/bin

.DEFAULT_GOAL := help

.PHONY: help
help: ## List the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-z][a-z-]*:.*## / {printf "  %-13s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: test
test: ## Run the tests with -race (PostgreSQL, RabbitMQ and NATS on loopback; see CONTRIBUTING.md)
	go test -race -count=1 -timeout 20m ./...

.PHONY: lint
lint: ## gofmt, go mod tidy and golangci-lint checks, as CI runs them
	@files="$$(gofmt -l .)"; if [ -n "$$files" ]; then echo "gofmt -l lists:"; echo "$$files"; exit 1; fi
	go mod tidy -diff
	@$(GOBIN)/golangci-lint version 2>/dev/null | grep -q "version $(GOLANGCI_LINT_VERSION:v%=%) " || \
		go install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_LINT_VERSION)
	$(GOBIN)/golangci-lint run --timeout 10m ./...

.PHONY: bench
bench: ## Run the benchmark against Watermill's forwarder (3 to 5 minutes; see docs/benchmarks.md)
	go run ./cmd/txoutbox-bench

.PHONY: bench-report
bench-report: ## Re-measure docs/benchmarks.md's tables and plots on PostgreSQL and MariaDB (about 45 minutes; a quiet machine)
	go run ./cmd/txoutbox-bench -repeat 3 -scenarios insert,drain,steady,latency,notify,hotkey,rss,outage -plot docs/benchmarks -report docs/benchmarks.md
	go run ./cmd/txoutbox-bench -db mysql -repeat 3 -plot docs/benchmarks/mysql -report docs/benchmarks.md

.PHONY: faults
faults: ## Run the fault suite alone, with a real PostgreSQL restart (see docs/reliability.md)
	TXOUTBOX_FAULT_PG_RESTART=require go test -count=1 -timeout 10m -run TestFaultTolerance ./internal/faulttest/

.PHONY: ci
ci: ## Run everything CI runs: start the services, checks, tests, faults, quick bench
	CI=true ./.ci/run
